"""Whether a run can run and where it goes, decided before Ray starts: composing the config
(:mod:`.compose`), key checks and overrides (:mod:`.keys`, :mod:`.overrides`), the one
`validate` (:mod:`.validate`), placement (:mod:`.placement`), the GPU memory plan
(:mod:`.memory`), the placement plan, made once per run and handed to the Ray layer, and the dry run
(:mod:`.layout`), node fit (:mod:`.node_fit`),
the teacher's derived config (:mod:`.teacher`) and the model a resumed checkpoint carries
(:mod:`.resume_model`); around them, Hydra's command-line conventions (:mod:`.cli`) and the
stop request that Ctrl-C and SIGTERM make (:mod:`.interrupt`). Ray-free; it imports the core packages and `rlcore.config`,
never `actors` or `rlcore.run`."""
