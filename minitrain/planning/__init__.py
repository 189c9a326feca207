"""What a run means and what it would take on a real cluster: :mod:`.analysis` (overlap, bubble,
prefetch from a run's timelines), :mod:`.costmodel` (the α-β model), :mod:`.clusters` (named
clusters, every number with its source), :mod:`.chooser` (which layout for which job), and the
projection — :mod:`.recording` (what a run's steps did), :mod:`.recorded` (read back as
programs), :mod:`.scaling` (at another model size), :mod:`.replay` (the discrete-event engine) and
:mod:`.projection` (the run re-timed on a cluster)."""
