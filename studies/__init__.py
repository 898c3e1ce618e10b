"""Studies that measure what OTB buys, one module per concept.

The evidence pipeline: `experiment` (an experiment file: arms x seeds over a recipe) -> `runs` (each run
trained in its own process, its committed record, the protocol stamp) -> `outcomes` (what the runs
achieved; a learning-rate ladder's collapses) -> `inference` (paired intervals, verdict rules, power) ->
`claims` (docs/results/claims.md). `compare` is the `python -m studies compare` command over that pipeline.
The variance study: `variance` (the policy gradient's noise at a fixed checkpoint, `python -m studies
variance`), its page `variance_page`, and `gradstats` (statistics of gradient estimates, shared with `toy`, an
exact-gradient testbed). Claim (a)'s registered studies (variance-a, variance-b): `variance_a` (the study,
its protocol and verdict), `variance_a_page` (its page) and `variance_a_cli` (`python -m studies
variance-a`). What training and benchmarks/ share with the studies lives below them, in
`studies.pages`, `otbrl.app.plots` and `otbrl.app.metrics`.
"""
