//! An in-process fabric for the worker's unit tests: writes are copies between registered regions
//! of "processes" that share one switch, immediates are counted like a NIC would. It keeps the
//! backend contract (count only after the bytes landed, refuse unknown rkeys and out-of-bounds
//! ranges, report every landing to the owner's landing log) and can corrupt chosen writes, so pipeline and receiver logic are tested without
//! sockets. The end-to-end suite uses the real TCP backend.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use weightsync_common::fabric::{
    Access, Endpoint, FabricBackend, FabricError, ImmCounter, Memory, Region, RegionDescriptor,
    RegisteredMemory, RemoteAccessKind, Result, WriteOp,
};

#[derive(Debug, Default)]
struct Switch {
    /// (endpoint, rkey) -> region.
    regions: Mutex<HashMap<(Endpoint, u64), Region>>,
    counters: Mutex<HashMap<Endpoint, ImmCounter>>,
    next_rkey: AtomicU64,
    /// Flip a byte of every write that lands at this (endpoint, rkey, offset).
    corrupt: Mutex<Option<(Endpoint, u64, u64)>>,
}

/// One process's handle.
#[derive(Debug, Clone)]
pub(crate) struct MemFabric {
    switch: Arc<Switch>,
    endpoint: Endpoint,
    counter: ImmCounter,
}

impl MemFabric {
    /// A fresh switch with one process on it.
    pub(crate) fn new_switch(name: &str) -> MemFabric {
        MemFabric::join(Arc::default(), name)
    }

    fn join(switch: Arc<Switch>, name: &str) -> MemFabric {
        let endpoint = Endpoint(name.to_owned());
        let counter = ImmCounter::new();
        switch
            .counters
            .lock()
            .insert(endpoint.clone(), counter.clone());
        MemFabric {
            switch,
            endpoint,
            counter,
        }
    }

    /// Another process on the same switch.
    pub(crate) fn peer(&self, name: &str) -> MemFabric {
        MemFabric::join(self.switch.clone(), name)
    }

    /// Corrupts writes landing at exactly `offset` of `desc`.
    pub(crate) fn corrupt_at(&self, desc: &RegionDescriptor, offset: u64) {
        *self.switch.corrupt.lock() = Some((desc.endpoint.clone(), desc.rkey, offset));
    }

    fn land(&self, op: &WriteOp) -> Result<()> {
        op.validate()?;
        let key = (op.dst.endpoint.clone(), op.dst.rkey);
        let dst =
            self.switch
                .regions
                .lock()
                .get(&key)
                .cloned()
                .ok_or(FabricError::RemoteAccess {
                    kind: RemoteAccessKind::WrongRkey,
                    peer: op.dst.endpoint.clone(),
                    rkey: op.dst.rkey,
                    offset: op.dst_offset,
                    len: op.len,
                })?;
        if !dst.access().contains(Access::REMOTE_WRITE) {
            return Err(FabricError::RemoteAccess {
                kind: RemoteAccessKind::NoWritePermission,
                peer: op.dst.endpoint.clone(),
                rkey: op.dst.rkey,
                offset: op.dst_offset,
                len: op.len,
            });
        }
        let mut bytes = match op.src_stride {
            None => op.src.copy_to_vec(op.src_offset, op.len as usize)?,
            Some(s) => {
                let mut gathered = Vec::with_capacity(op.len as usize);
                for (at, n) in s.segments(op.src_offset, op.len) {
                    gathered.extend(op.src.copy_to_vec(at, n as usize)?);
                }
                gathered
            }
        };
        if let Some((ep, rkey, off)) = self.switch.corrupt.lock().clone()
            && ep == op.dst.endpoint
            && rkey == op.dst.rkey
            && off == op.dst_offset
            && !bytes.is_empty()
        {
            bytes[0] ^= 0x5a;
        }
        {
            // Like the TCP receiver: the owner's landing log sees the write begin and end.
            let _logged = dst.memory().landing(op.dst_offset, op.len);
            dst.write_at(op.dst_offset, &bytes)?;
        }
        if let Some(imm) = op.imm {
            let counter = self.switch.counters.lock().get(&op.dst.endpoint).cloned();
            if let Some(c) = counter {
                c.record_arrival(imm);
            }
        }
        Ok(())
    }
}

impl FabricBackend for MemFabric {
    fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    fn lanes_per_peer(&self) -> usize {
        1
    }

    fn register(&self, memory: Memory, access: Access) -> Result<Region> {
        let rkey = self.switch.next_rkey.fetch_add(1, Ordering::Relaxed) + 1;
        let mem = RegisteredMemory::new_reporting_landings(memory);
        let desc = RegionDescriptor {
            endpoint: self.endpoint.clone(),
            base: mem.as_ptr() as u64,
            len: mem.len() as u64,
            rkey,
        };
        let region = Region::new(mem, access, desc, Box::new(|| {}));
        self.switch
            .regions
            .lock()
            .insert((self.endpoint.clone(), rkey), region.clone());
        Ok(region)
    }

    fn write(&self, op: WriteOp) -> impl Future<Output = Result<()>> + Send + 'static {
        let this = self.clone();
        async move {
            tokio::task::yield_now().await;
            this.land(&op)
        }
    }

    fn write_batch(&self, ops: Vec<WriteOp>) -> impl Future<Output = Result<()>> + Send + 'static {
        let this = self.clone();
        async move {
            tokio::task::yield_now().await;
            for op in &ops {
                this.land(op)?;
            }
            Ok(())
        }
    }

    fn connect(&self, _peer: &Endpoint) -> impl Future<Output = Result<()>> + Send + 'static {
        std::future::ready(Ok(()))
    }

    fn imm_counter(&self) -> &ImmCounter {
        &self.counter
    }

    fn reset_connections(&self) -> impl Future<Output = ()> + Send + 'static {
        // Nothing to discard: a write here lands only while its future is polled, so a write
        // whose future was dropped never lands later.
        std::future::ready(())
    }
}
