"""What a run tells its user: console lines (:mod:`.console`), start-up phases (:mod:`.startup`),
metrics sinks (:mod:`.metrics`), sample tables (:mod:`.samples`), failure counts
(:mod:`.failures`), busy clocks (:mod:`.busy`), the summary (:mod:`.summary`) and the plot
(:mod:`.plot`), evaluation's pure parts (:mod:`.evaluation`), faults named for what they are
(:mod:`.faults`), and the recorded timeline: each process's trace (:mod:`.profiling`) and their
merge (:mod:`.timeline`). Ray-free."""
