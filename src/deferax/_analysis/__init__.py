"""The analysis: which expensive calls of the traced program may run on a deferred schedule."""
