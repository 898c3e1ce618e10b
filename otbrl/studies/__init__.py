"""Studies behind the `otbrl` subcommands: experiments on a tiny model that measure estimator claims and
write their tables and plots under docs/results/."""
