"""Examples of kfac_hpc (importable as ``examples.<name>`` from the repository root)."""
