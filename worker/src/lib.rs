//! weightsync-worker: trainer pipeline and rollout receiver. (Being built: see issue 4.)
