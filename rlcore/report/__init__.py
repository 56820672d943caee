"""What a run tells its user: console lines (:mod:`.console`), start-up phases (:mod:`.startup`),
metrics sinks (:mod:`.metrics`), sample tables (:mod:`.samples`), failure counts
(:mod:`.failures`), busy clocks (:mod:`.busy`), the summary (:mod:`.summary`) and the plot
(:mod:`.plot`). Ray-free."""
