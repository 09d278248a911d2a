//! weightsync-tests: shared harness code for the suites under `tests/tests/`.
