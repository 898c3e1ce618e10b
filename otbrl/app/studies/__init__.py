"""Studies that measure what OTB buys: gradient variance at a fixed checkpoint (`variance`), training runs
compared over estimators, group sizes and seeds (`compare`), the paper's claims judged from both (`claims`)
and an exact-gradient toy (`toy`); the other modules are their shared parts (runs, statistics, plots)."""
