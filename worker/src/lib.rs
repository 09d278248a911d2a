//! weightsync-worker: trainer pipeline and rollout receiver. (Being built: see issue 4.)

#[cfg(feature = "cuda")]
pub mod gpu;
pub mod prepare;
pub mod source;

pub mod checksum;
pub mod error;
pub mod imm_tag;
#[cfg(test)]
mod mem_fabric;
pub mod rollout;
pub mod timeline;
pub mod trainer;
pub mod watermark;
