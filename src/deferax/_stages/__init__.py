"""The three stages of a deferred schedule, as interpreters over the one traced program."""
