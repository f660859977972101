"""The sparse direct solvers beside `SuperLU` (`_solver.py`), one a file: CHOLMOD's
Cholesky (`_cholmod.py`), KLU (`_klu.py`), and the default that measures them (`_auto.py`)."""
