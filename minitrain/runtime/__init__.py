"""Starting and watching ranks: :mod:`.launch` (``Cluster`` and ``launch``, the parent's side),
:mod:`.worker` (what a rank runs), :mod:`.watch` (a waiting rank told from a working one),
:mod:`.rankfolder` (each start's folder), :mod:`.diagnostics` (a failure as data),
:mod:`.shipping` (a notebook's function reaching the ranks), :mod:`.torchrun` (joining a group
torchrun started) and :mod:`.benchmarking` (two implementations timed in turns).  Nothing here
imports the rest of the package."""
