"""The course machinery beside the teaching core: :mod:`.exercises` (a checker per lesson, the
guards around a learner's function, the debugging lab, the lessons' builder), :mod:`.grade` (a
class's notebooks into a gradebook) and :mod:`.sandbox` (each notebook sealed off), with the
programs the grader runs inside the sandbox (:mod:`.runner`, :mod:`.take`, :mod:`.judge`,
:mod:`.probe`)."""
