"""Studies that measure what OTB buys: gradient variance at a fixed checkpoint (`variance`) and training
runs compared over estimators, group sizes and seeds (`compare`). Each writes tables and plots."""
