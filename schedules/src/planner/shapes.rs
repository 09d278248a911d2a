//! Task shapes, for emission (step 5): what a task's writes and pattern depend on, worked out
//! once per shape instead of once per task.
//!
//! Why: a task's writes depend only on its box, its transform, whether it reads the gather arena
//! and how its destination group's targets are laid out (where the box sits in their tensors,
//! the tensors' shapes and MRs, which targets are copies of which) -- not on which trainer sends
//! it, which rank receives it or where exactly the target tensors lie. Kimi-K2 emits 2 million
//! tasks of a few thousand such shapes (every expert of a layer, every layer, repeat them). So
//! emission cuts a shape's runs once, relative to its targets' tensor offsets ([`ShapeMemo`]),
//! and each trainer looks a shape's pattern up once ([`KnownShapes`]); a task then only adds its
//! record and the ranks and offsets of its writes. The table is the same as when every task is
//! cut and its pattern found by content: a trainer's first task of a shape still goes through
//! [`crate::compact::RoutesBuilder::push_task`], which numbers patterns in the same order.
//!
//! A gather send (a part of a gather region written into its owner's arena) has a shape too:
//! its part, the region's box and the two element types ([`GatherKey`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use smallvec::SmallVec;
use weightsync_common::DType;

use super::targets::TargetPlan;
use crate::table::{TensorBox, Transform};

/// A fast hasher for small plain keys (words mixed as they come; not for untrusted input,
/// which emission's keys are not: they are the planner's own boxes and codes).
#[derive(Default, Clone, Copy)]
pub(super) struct KeyHasher(u64);

impl KeyHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ (rest.len() as u64) << 59);
        }
    }

    #[inline]
    fn write_u8(&mut self, x: u8) {
        self.add(x as u64);
    }

    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.add(x as u64);
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.add(x);
    }

    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.add(x as u64);
    }
}

/// Hash maps keyed by [`KeyHasher`].
pub(super) type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// What a task's writes and pattern depend on beyond its target layout class (see the module
/// docs).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct ShapeKey {
    bx: TensorBox,
    transform: Transform,
    gather: bool,
}

/// What a gather send's writes and pattern depend on: its part, the gather region's box, the
/// owner's element type (the arena's) and the sender's (the transform's).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GatherKey {
    pub(super) part: TensorBox,
    pub(super) region: TensorBox,
    pub(super) owner: DType,
    pub(super) sender: DType,
}

/// A write of a shape, its rank and offset relative to a listed target (or, for a gather send,
/// to the owner's arena offset of the region).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct ShapeWrite {
    /// Index of the listed target it goes to (0 for a gather send).
    pub(super) listed: u32,
    /// Whether it lands in the target's scale tensor (else its weight tensor).
    pub(super) scale: bool,
    pub(super) mr: u16,
    pub(super) len: u32,
    pub(super) src_offset: u64,
    /// Offset from the start of the tensor (or region) it lands in.
    pub(super) dst: u64,
}

/// One shape's writes: `writes[first..first + num]`, and per listed target where its writes
/// start among them and how many there are (`listed[first_listed..]`, one per listed target).
#[derive(Clone, Copy)]
struct ShapeEntry {
    first: u32,
    num: u32,
    first_listed: u32,
    num_listed: u32,
}

/// The shapes met so far, each with its writes (see the module docs).
///
/// Finding a shape by hashing its key would cost about as much per task as cutting its runs,
/// so each class keeps its shapes in the order first met, and a lookup first tries the shape
/// after the one found last ([`Cursor`]): the tasks of a destination group come in region
/// order, the same for every group of its class, so that guess nearly always holds. Gather
/// sends are guessed the same way in one list. Only a wrong guess hashes.
#[derive(Default)]
pub(super) struct ShapeMemo {
    /// Target layout classes by their signature, and per class its shapes in the order met.
    classes: KeyMap<SmallVec<[u64; 32]>, u32>,
    class_shapes: Vec<Vec<(ShapeKey, u32)>>,
    /// Task shapes by class and key, and gather-send shapes by key (ids in one numbering),
    /// each with its position in its list.
    tasks: KeyMap<(u32, ShapeKey), (u32, u32)>,
    gathers: KeyMap<GatherKey, (u32, u32)>,
    gather_shapes: Vec<(GatherKey, u32)>,
    entries: Vec<ShapeEntry>,
    writes: Vec<ShapeWrite>,
    /// Per shape and listed target: (first write, number of writes), relative to the shape.
    listed: Vec<(u32, u32)>,
    /// Scratch for a signature.
    sig: SmallVec<[u64; 32]>,
}

impl ShapeMemo {
    /// The class of a target plan: plans of one class give a box the same writes but for their
    /// ranks and the offsets of the target tensors, and the same copies relative to those ranks.
    pub(super) fn class_of(&mut self, plan: &TargetPlan) -> u32 {
        let sig = &mut self.sig;
        sig.clear();
        sig.push(plan.listed.len() as u64);
        for l in &plan.listed {
            let pc = &l.piece;
            sig.extend(pc.src.start.iter().map(|&x| x as u64));
            sig.extend(pc.dst_start.iter().map(|&x| x as u64));
            sig.push(l.shape.ndim as u64);
            sig.extend(l.shape.dims.iter().map(|&x| x as u64));
            sig.push(l.elem);
            sig.push(l.mr as u64);
            match (l.scales, pc.scale) {
                (Some((shape, mr, _)), Some(place)) => {
                    sig.push(1 + mr as u64);
                    sig.push(shape.ndim as u64);
                    sig.extend(shape.dims.iter().map(|&x| x as u64));
                    sig.extend(place.start.iter().map(|&x| x as u64));
                }
                (None, None) => sig.push(0),
                // Cannot happen (a listed target has scales exactly when its piece has a
                // place for them); kept apart from both cases above all the same.
                _ => sig.push(u64::MAX),
            }
        }
        sig.push(plan.copies.len() as u64);
        for c in &plan.copies {
            let base_rank = plan.listed[c.base as usize].piece.rank;
            sig.push(c.base as u64);
            sig.push(c.first_rank.wrapping_sub(base_rank) as u64);
            sig.push(c.stride as u64);
            sig.push(c.count as u64);
        }
        let next = self.classes.len() as u32;
        let class = *self.classes.entry(sig.clone()).or_insert(next);
        if class == next {
            self.class_shapes.push(Vec::new());
        }
        class
    }

    /// The id of the task shape `(class, bx, transform, gather)`, with `cut` filling its
    /// writes (relative to the listed targets) and per listed target its (first, number) of
    /// writes, the first time the shape is met. `cursor` is where the class's last lookup
    /// ended (0 for the first task of a destination group).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn task_shape(
        &mut self,
        class: u32,
        bx: TensorBox,
        transform: Transform,
        gather: bool,
        cursor: &mut Cursor,
        cut: impl FnOnce(&mut Vec<ShapeWrite>, &mut Vec<(u32, u32)>),
    ) -> u32 {
        let key = ShapeKey {
            bx,
            transform,
            gather,
        };
        let list = &self.class_shapes[class as usize];
        if let Some((pos, id)) = guess(list, cursor, &key) {
            cursor.0 = pos + 1;
            return id;
        }
        if let Some(&(id, pos)) = self.tasks.get(&(class, key)) {
            cursor.0 = pos + 1;
            return id;
        }
        let id = self.add(cut);
        let list = &mut self.class_shapes[class as usize];
        list.push((key, id));
        cursor.0 = list.len() as u32;
        self.tasks.insert((class, key), (id, cursor.0 - 1));
        id
    }

    /// The id of a gather send's shape, with `cut` filling its writes (relative to the
    /// region's arena offset) the first time it is met. `cursor` is where the last lookup of
    /// a gather send ended.
    pub(super) fn gather_shape(
        &mut self,
        key: GatherKey,
        cursor: &mut Cursor,
        cut: impl FnOnce(&mut Vec<ShapeWrite>, &mut Vec<(u32, u32)>),
    ) -> u32 {
        if let Some((pos, id)) = guess(&self.gather_shapes, cursor, &key) {
            cursor.0 = pos + 1;
            return id;
        }
        if let Some(&(id, pos)) = self.gathers.get(&key) {
            cursor.0 = pos + 1;
            return id;
        }
        let id = self.add(cut);
        self.gather_shapes.push((key, id));
        cursor.0 = self.gather_shapes.len() as u32;
        self.gathers.insert(key, (id, cursor.0 - 1));
        id
    }

    fn add(&mut self, cut: impl FnOnce(&mut Vec<ShapeWrite>, &mut Vec<(u32, u32)>)) -> u32 {
        let id = self.entries.len() as u32;
        let (first, first_listed) = (self.writes.len(), self.listed.len());
        cut(&mut self.writes, &mut self.listed);
        self.entries.push(ShapeEntry {
            first: first as u32,
            num: (self.writes.len() - first) as u32,
            first_listed: first_listed as u32,
            num_listed: (self.listed.len() - first_listed) as u32,
        });
        id
    }

    /// The writes of shape `id`.
    #[inline]
    pub(super) fn writes(&self, id: u32) -> &[ShapeWrite] {
        let e = &self.entries[id as usize];
        &self.writes[e.first as usize..(e.first + e.num) as usize]
    }

    /// Per listed target of shape `id`: its (first, number) of writes.
    #[inline]
    pub(super) fn listed(&self, id: u32) -> &[(u32, u32)] {
        let e = &self.entries[id as usize];
        &self.listed[e.first_listed as usize..(e.first_listed + e.num_listed) as usize]
    }
}

/// Where the next shape is guessed to be in its list ([`ShapeMemo`]).
#[derive(Default, Clone, Copy)]
pub(super) struct Cursor(u32);

/// How far past the cursor a lookup looks before it hashes: a part of emission that skips
/// other parts' tasks ([`Planner::emit`](super::Planner)) finds its next shape a few places on.
const GUESS_AHEAD: usize = 4;

/// The position and id of `key` among the few shapes of `list` at and after `cursor` (a key is
/// in its list once).
#[inline]
fn guess<K: PartialEq>(list: &[(K, u32)], cursor: &Cursor, key: &K) -> Option<(u32, u32)> {
    let at = cursor.0 as usize;
    let ahead = list.get(at..)?;
    ahead
        .iter()
        .take(GUESS_AHEAD)
        .position(|(k, _)| k == key)
        .map(|i| ((at + i) as u32, ahead[i].1))
}

/// A trainer's pattern for each shape it has sent a task of.
pub(super) type KnownShapes = KeyMap<u32, u32>;
