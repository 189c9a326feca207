"""Checkpoint files: :mod:`.core` saves, verifies and resumes them (what goes in a rank's file is
its strategy's checkpointer's), :mod:`.format` names the folders and files and checks
``meta.json``, :mod:`.checks` refuses a ``--save-dir`` or ``--resume`` that cannot work before any
process starts, and :mod:`.consolidate` reads a checkpoint offline (lesson 08)."""
