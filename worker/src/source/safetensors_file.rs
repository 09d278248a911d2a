//! A safetensors file as the source arena.
//!
//! The file names tensors; the routing table places them at arena offsets. Loading maps the
//! file, checks every expected tensor (present, same dtype, same shape, hence same length) and
//! only then copies each into its offset of a host arena. The copy happens once, at load:
//! file offsets and arena offsets rarely coincide, and a sync then reads plain memory.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};
use weightsync_common::DType;

use super::{ArenaTensor, check_layout};
use crate::error::SourceError;

/// A source arena loaded from a safetensors file.
#[derive(Debug)]
pub struct SafetensorsSource {
    path: PathBuf,
    arena: Vec<u8>,
}

fn dtype_of(d: Dtype) -> Option<DType> {
    match d {
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        Dtype::F32 => Some(DType::F32),
        Dtype::F8_E4M3 => Some(DType::F8E4M3),
        _ => None,
    }
}

impl SafetensorsSource {
    /// Loads `tensors` from the file at `path` into an arena of `arena_len` bytes (bytes not
    /// covered by any tensor are zero). Every tensor is checked before any byte is copied.
    pub fn load(
        path: impl AsRef<Path>,
        tensors: &[ArenaTensor],
        arena_len: u64,
    ) -> Result<SafetensorsSource, SourceError> {
        let path = path.as_ref().to_path_buf();
        check_layout(tensors, arena_len)?;
        let io = |source| SourceError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: read-only mapping of a checkpoint file that is only read during `load`, and
        // dropped before it returns; a checkpoint is not rewritten while it is being loaded.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let st = SafeTensors::deserialize(&map).map_err(|e| SourceError::Safetensors {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let mut views = Vec::with_capacity(tensors.len());
        for t in tensors {
            let view = st.tensor(&t.name).map_err(|_| SourceError::MissingTensor {
                path: path.clone(),
                name: t.name.clone(),
            })?;
            let found = view.dtype();
            if dtype_of(found) != Some(t.dtype) {
                return Err(SourceError::DTypeMismatch {
                    name: t.name.clone(),
                    expected: t.dtype,
                    found: format!("{found:?}"),
                });
            }
            if view.shape() != t.shape.as_slice() {
                return Err(SourceError::ShapeMismatch {
                    name: t.name.clone(),
                    expected: t.shape.clone(),
                    found: view.shape().to_vec(),
                });
            }
            // Same dtype and shape imply the same length; safetensors checked the data range.
            views.push((t.offset as usize, view.data()));
        }
        let mut arena = vec![0u8; arena_len as usize];
        views.sort_by_key(|&(off, _)| off);
        // Split the arena into disjoint pieces, one per tensor, and fill them in parallel.
        let mut pieces = Vec::with_capacity(views.len());
        let mut rest: &mut [u8] = &mut arena;
        let mut at = 0usize;
        for (off, data) in views {
            if off < at {
                return Err(SourceError::Layout(format!(
                    "tensors overlap at arena offset {off}"
                )));
            }
            let (_, tail) = rest.split_at_mut(off - at);
            let (dst, tail) = tail.split_at_mut(data.len());
            pieces.push((dst, data));
            rest = tail;
            at = off + data.len();
        }
        pieces
            .into_par_iter()
            .for_each(|(dst, data)| dst.copy_from_slice(data));
        Ok(SafetensorsSource { path, arena })
    }

    /// The arena.
    pub fn as_slice(&self) -> &[u8] {
        &self.arena
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write_file(entries: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> tempfile::NamedTempFile {
        let views: Vec<(String, TensorView<'_>)> = entries
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let bytes = safetensors::serialize(views, None).unwrap();
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), bytes).unwrap();
        f
    }

    fn expect(name: &str, dtype: DType, shape: &[usize], offset: u64) -> ArenaTensor {
        ArenaTensor {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            offset,
        }
    }

    #[test]
    fn places_tensors_at_their_arena_offsets() {
        let f = write_file(&[
            ("w", Dtype::BF16, vec![2, 3], (1..=12).collect()),
            ("b", Dtype::F32, vec![2], vec![0xAB; 8]),
        ]);
        let layout = [
            expect("b", DType::F32, &[2], 0),
            expect("w", DType::BF16, &[2, 3], 16),
        ];
        let src = SafetensorsSource::load(f.path(), &layout, 32).unwrap();
        let a = src.as_slice();
        assert_eq!(&a[0..8], &[0xAB; 8]);
        assert_eq!(&a[8..16], &[0; 8]);
        assert_eq!(&a[16..28], &(1..=12).collect::<Vec<u8>>()[..]);
    }

    #[test]
    fn refuses_mismatches_naming_the_tensor() {
        let f = write_file(&[("w", Dtype::F16, vec![2, 3], vec![0; 12])]);
        let err = SafetensorsSource::load(f.path(), &[expect("w", DType::BF16, &[2, 3], 0)], 12)
            .unwrap_err();
        assert!(matches!(err, SourceError::DTypeMismatch { .. }), "{err}");
        assert!(
            err.to_string().contains("\"w\"") && err.to_string().contains("bf16"),
            "{err}"
        );
        let err = SafetensorsSource::load(f.path(), &[expect("w", DType::F16, &[3, 2], 0)], 12)
            .unwrap_err();
        assert!(matches!(err, SourceError::ShapeMismatch { .. }), "{err}");
        let err = SafetensorsSource::load(f.path(), &[expect("v", DType::F16, &[2, 3], 0)], 12)
            .unwrap_err();
        assert!(err.to_string().contains("\"v\" is missing"), "{err}");
        let err = SafetensorsSource::load(f.path(), &[expect("w", DType::F16, &[2, 3], 4)], 12)
            .unwrap_err();
        assert!(matches!(err, SourceError::Layout(_)), "{err}");
        std::fs::write(f.path(), b"not a safetensors file").unwrap();
        let err = SafetensorsSource::load(f.path(), &[], 0).unwrap_err();
        assert!(matches!(err, SourceError::Safetensors { .. }), "{err}");
    }
}
