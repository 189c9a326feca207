"""The techniques, one per file, each the technique alone: torch-shaped wrappers and functions that
take their process group (a :class:`minitrain.comm.Comm`) as an argument, with explicit seams where a
learner's function can replace the package's.  A seam is a parameter that takes a function of one
fixed shape (``hook(unit, comm, moment)``, ``all_reduce(tensor, comm) -> the sum``, ...); its default
is the package's function of that shape, called on the same line, and nothing here asks which
function it was given.  What protects a run from a learner's function wraps it before it gets here
(:mod:`minitrain.course.exercises.guards`).  Nothing here knows the CLI, the strategies' names or checkpoint
files: that harness is :mod:`minitrain.strategies`; what a run's records say is
:mod:`minitrain.planning.analysis`."""
