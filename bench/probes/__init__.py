"""One-question experiments, run from the repository root: `python -m bench.probes.<name>`. Each imports the
shared helpers of bench (bench._common) and mage_gen, never another probe."""
