//! Memory fenced by guard pages and filled with canary bytes, to prove refused writes touch nothing.
//!
//! A [`GuardedPages`] maps `pages + 2` pages and makes the first and the last `PROT_NONE`: a
//! backend that wrote even one byte past either end of the usable pages would kill the test
//! process with SIGSEGV instead of silently corrupting a neighbour. Inside the usable pages the
//! test registers one or more regions (adjacent ones too) and fills everything with a canary
//! pattern, so a check after a refused write can compare every byte, inside and outside the
//! region the write named.
//!
//! All `unsafe` of the suites lives here, behind [`GuardedPages`] (owns the mapping, unmaps on
//! drop) and [`GuardedRegion`] (a registration that is dropped before the mapping it points into).

use std::sync::Arc;

use weightsync_common::fabric::{
    Access, FabricBackend, Memory, MemoryLocation, PAGE_SIZE, RawMemory, Region, RegionDescriptor,
};

/// A mapping of usable pages between two inaccessible guard pages. Unmapped on drop.
#[derive(Debug)]
pub struct GuardedPages {
    base: *mut u8,
    usable_len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; concurrent access through raw
// pointers is what the fabric does with registered memory and is synchronised by the protocol.
unsafe impl Send for GuardedPages {}
// SAFETY: see `Send`; `&GuardedPages` only reads or writes bytes through raw pointers.
unsafe impl Sync for GuardedPages {}

impl GuardedPages {
    /// Maps `pages` usable pages with a guard page on each side.
    pub fn new(pages: usize) -> std::io::Result<GuardedPages> {
        assert!(pages > 0, "at least one usable page");
        let total = (pages + 2) * PAGE_SIZE;
        // SAFETY: an anonymous private mapping with no address hint has no preconditions.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let p = p.cast::<u8>();
        let tail = (pages + 1) * PAGE_SIZE;
        // SAFETY: both ranges are whole pages inside the mapping created above.
        let rc = unsafe {
            libc::mprotect(p.cast(), PAGE_SIZE, libc::PROT_NONE)
                | libc::mprotect(p.add(tail).cast(), PAGE_SIZE, libc::PROT_NONE)
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: unmapping exactly the mapping created above, which nothing else references.
            unsafe { libc::munmap(p.cast(), total) };
            return Err(e);
        }
        Ok(GuardedPages {
            // SAFETY: one page past the start is inside the mapping.
            base: unsafe { p.add(PAGE_SIZE) },
            usable_len: pages * PAGE_SIZE,
        })
    }

    /// Usable bytes.
    pub fn len(&self) -> usize {
        self.usable_len
    }

    /// Whether there are no usable bytes (never: at least one page).
    pub fn is_empty(&self) -> bool {
        self.usable_len == 0
    }

    /// First usable byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }

    /// Fills every usable byte with `pattern(i)`.
    pub fn fill_with(&self, pattern: impl Fn(usize) -> u8) {
        for i in 0..self.usable_len {
            // SAFETY: `i < usable_len`, inside the read-write part of the mapping.
            unsafe { self.base.add(i).write_volatile(pattern(i)) };
        }
    }

    /// Copies every usable byte out.
    pub fn snapshot(&self) -> Vec<u8> {
        (0..self.usable_len)
            // SAFETY: `i < usable_len`, inside the read-write part of the mapping.
            .map(|i| unsafe { self.base.add(i).read_volatile() })
            .collect()
    }
}

impl Drop for GuardedPages {
    fn drop(&mut self) {
        // SAFETY: unmapping the whole mapping created in `new` (base minus the leading guard page);
        // every `GuardedRegion` holds an `Arc` of this value, so none is registered any more.
        unsafe {
            libc::munmap(
                self.base.sub(PAGE_SIZE).cast(),
                self.usable_len + 2 * PAGE_SIZE,
            )
        };
    }
}

/// The canary pattern: distinct per position so shifted or partial writes are visible.
pub fn canary(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ 0xA5) as u8
}

/// A registration of part of a [`GuardedPages`] mapping.
///
/// Field order matters: the region (deregistered when its last clone drops) goes before the
/// mapping. Only `&Region` and descriptors are handed out, so no clone outlives this value.
#[derive(Debug)]
pub struct GuardedRegion {
    region: Region,
    pages: Arc<GuardedPages>,
    offset: usize,
}

impl GuardedRegion {
    /// Registers `[offset, offset + len)` of `pages` with `fabric`.
    pub fn register<B: FabricBackend>(
        fabric: &B,
        pages: &Arc<GuardedPages>,
        offset: usize,
        len: usize,
        access: Access,
    ) -> weightsync_common::fabric::Result<GuardedRegion> {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= pages.len()),
            "region [{offset}, +{len}) outside the usable pages"
        );
        // SAFETY: the range lies inside the usable pages (asserted above), which stay mapped while
        // `pages` lives; this value holds an `Arc` of them and drops the region first. Peers may
        // write into it while registered; the suites read it only through volatile raw reads.
        let raw = unsafe { RawMemory::new(pages.as_ptr().add(offset), len, MemoryLocation::Host) };
        let region = fabric.register(Memory::Raw(raw), access)?;
        Ok(GuardedRegion {
            region,
            pages: pages.clone(),
            offset,
        })
    }

    /// The registration (do not keep clones beyond this value's life).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// What a peer needs to write here.
    pub fn descriptor(&self) -> RegionDescriptor {
        self.region.descriptor().clone()
    }

    /// Offset of the region inside its mapping.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The mapping.
    pub fn pages(&self) -> &Arc<GuardedPages> {
        &self.pages
    }
}

/// The first position where `after` differs from `before` outside `[allowed.0, allowed.1)`.
pub fn first_change_outside(before: &[u8], after: &[u8], allowed: (usize, usize)) -> Option<usize> {
    before
        .iter()
        .zip(after)
        .enumerate()
        .find(|(i, (b, a))| (*i < allowed.0 || *i >= allowed.1) && b != a)
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_pages_map_fill_and_compare() {
        let g = GuardedPages::new(2).unwrap();
        g.fill_with(canary);
        let before = g.snapshot();
        assert_eq!(before.len(), 2 * PAGE_SIZE);
        // SAFETY: offset 10 is inside the usable pages.
        unsafe { g.as_ptr().add(10).write_volatile(before[10] ^ 1) };
        let after = g.snapshot();
        assert_eq!(first_change_outside(&before, &after, (0, 0)), Some(10));
        assert_eq!(first_change_outside(&before, &after, (5, 11)), None);
    }
}
