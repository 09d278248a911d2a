//! The fabric: one-sided WRITE with immediates. (Being built: see issue 2.)
