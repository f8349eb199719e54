"""XLA's default backend optimisation level, as compiler options: what a user's programs compile with.

tests/conftest.py compiles the CPU test session with LLVM's optimisation off (it costs most of the suite's time and
no check measures it). A test that compares two different programs bit for bit, where the equality rests on how LLVM
optimises them, compiles both with these options. No side effects: worker processes import it too."""

XLA_DEFAULT_CODEGEN = {"xla_backend_optimization_level": 3}
