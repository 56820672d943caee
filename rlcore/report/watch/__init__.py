"""The live run page: `python -m rlcore.watch OUTPUT_DIR [OUTPUT_DIR ...]` serves a read-only
page that follows one or more runs from the files they write (metrics.jsonl, samples.jsonl,
events.jsonl, the checkpoint folders). Ray-free; its assets ship in `rlcore/report/watch_static/`."""
