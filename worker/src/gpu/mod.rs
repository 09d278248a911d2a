//! GPU (being written).
