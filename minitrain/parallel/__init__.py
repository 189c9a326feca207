"""The techniques, one per file, each the technique alone: torch-shaped wrappers and functions that
take their process group (a :class:`minitrain.comm.Comm`) as an argument, with explicit seams where a
learner's function can replace the package's.  Nothing here knows the CLI, the strategies' names or
checkpoint files: that harness is :mod:`minitrain.strategies`."""
