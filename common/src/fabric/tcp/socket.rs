//! The few raw socket calls the data path needs, and the only `unsafe` of the TCP backend's I/O.
//!
//! Why raw calls: the receiver must read a payload *straight into registered memory* (a raw
//! pointer, not a Rust slice, since peers may be changing other parts of the region), and the
//! writer sends header and payload in one `sendmsg` from a raw source pointer. Every call is
//! non-blocking; waiting happens in [`LaneSocket::wait`] (`poll(2)`) *without* holding the
//! region's revocation guard, so deregistration is never delayed by a slow peer.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a wait or read ended without success.
#[derive(Debug)]
pub enum IoFail {
    /// The peer closed the connection cleanly, before the first byte of a message.
    Closed,
    /// The peer closed the connection in the middle of a message.
    Eof,
    /// No progress within the limit.
    TimedOut,
    /// The fabric is shutting down.
    Shutdown,
    /// The writer reset the connection ([`LaneSocket::abort`]); what it had sent and this end
    /// has not landed yet is discarded.
    PeerReset,
    /// An OS error.
    Os(io::Error),
}

impl std::fmt::Display for IoFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoFail::Closed => f.write_str("connection closed by peer"),
            IoFail::Eof => f.write_str("connection closed by peer mid-message"),
            IoFail::TimedOut => f.write_str("no progress within the I/O timeout"),
            IoFail::Shutdown => f.write_str("fabric shutting down"),
            IoFail::PeerReset => f.write_str("the writer reset the connection"),
            IoFail::Os(e) => write!(f, "{e}"),
        }
    }
}

/// What to wait for.
#[derive(Debug, Clone, Copy)]
pub enum Readiness {
    /// Readable (or closed).
    Read,
    /// Writable.
    Write,
}

/// How often a waiting thread checks the shutdown flag.
const TICK: Duration = Duration::from_millis(100);

/// Waits until `fd` is ready, checking `stop` every tick; `limit` of `None` waits forever.
pub fn wait_fd(
    fd: RawFd,
    what: Readiness,
    limit: Option<Duration>,
    stop: &AtomicBool,
) -> Result<(), IoFail> {
    let start = Instant::now();
    let events = match what {
        Readiness::Read => libc::POLLIN,
        Readiness::Write => libc::POLLOUT,
    };
    loop {
        if stop.load(Ordering::Relaxed) {
            return Err(IoFail::Shutdown);
        }
        let tick = match limit {
            Some(l) => {
                let elapsed = start.elapsed();
                if elapsed >= l {
                    return Err(IoFail::TimedOut);
                }
                (l - elapsed).min(TICK)
            }
            None => TICK,
        };
        let mut pfd = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: pfd is a valid pollfd for the duration of the call and nfds is 1.
        let rc = unsafe { libc::poll(&mut pfd, 1, tick.as_millis().max(1) as libc::c_int) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(IoFail::Os(e));
            }
        }
    }
}

/// A connected, non-blocking lane socket.
#[derive(Debug)]
pub struct LaneSocket {
    stream: TcpStream,
}

impl LaneSocket {
    /// Switches the stream to non-blocking mode and wraps it.
    pub fn new(stream: TcpStream) -> io::Result<LaneSocket> {
        stream.set_nonblocking(true)?;
        Ok(LaneSocket { stream })
    }

    /// The raw descriptor.
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Shuts both directions down (wakes every thread waiting on it).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Aborts the connection: resets it (RST) and discards whatever the kernel still holds in
    /// its send queue, then shuts it down. A failed lane must do this rather than a graceful
    /// shutdown: after a partition heals, TCP would otherwise still deliver the queued frames of
    /// a sync that has already been failed, and their bytes would land during the next one.
    pub fn abort(&self) {
        // SAFETY: `addr` is a zeroed sockaddr whose family is AF_UNSPEC and whose size is passed;
        // fd is an open socket. connect(AF_UNSPEC) on a TCP socket disconnects it (tcp_disconnect:
        // RST, send queue purged); an error only means there was nothing left to reset.
        unsafe {
            let mut addr: libc::sockaddr = std::mem::zeroed();
            addr.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
            libc::connect(
                self.fd(),
                &addr,
                std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
            );
        }
        self.shutdown();
    }

    /// Whether the peer reset the connection (an RST arrived: the TCP state is `CLOSE`). The
    /// kernel still hands out bytes that arrived before the RST; a receiver checks this so that
    /// it does not land frames a writer abandoned by resetting its lane.
    pub fn reset_by_peer(&self) -> bool {
        // SAFETY: tcp_info is plain data, so zeroed is a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: info is a live tcp_info of `len` bytes, len is updated by the kernel; fd is an
        // open socket.
        let rc = unsafe {
            libc::getsockopt(
                self.fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        };
        // TCP_CLOSE is 7 in the kernel's tcp_states.h.
        rc == 0 && info.tcpi_state == 7
    }

    /// Sets `SO_RCVLOWAT`: a wait for readability ends only once `bytes` are queued (or the
    /// connection closed, or the kernel sees that the rest cannot arrive before a read). The
    /// kernel caps it at half the receive buffer.
    pub fn set_rcvlowat(&self, bytes: usize) -> io::Result<()> {
        set_int_option(self.fd(), libc::SOL_SOCKET, libc::SO_RCVLOWAT, bytes.max(1))
    }

    /// Waits until the socket is ready.
    pub fn wait(
        &self,
        what: Readiness,
        limit: Option<Duration>,
        stop: &AtomicBool,
    ) -> Result<(), IoFail> {
        wait_fd(self.fd(), what, limit, stop)
    }

    /// Receives up to `len` bytes into `ptr` without blocking.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes for the duration of the call.
    pub unsafe fn recv_raw(&self, ptr: *mut u8, len: usize) -> io::Result<usize> {
        // SAFETY: the caller guarantees ptr is writable for len bytes; fd is an open socket.
        let rc = unsafe { libc::recv(self.fd(), ptr.cast(), len, libc::MSG_DONTWAIT) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc as usize)
        }
    }

    /// Receives into `first`, then `second`, in one call without blocking; returns the bytes
    /// received (those beyond `first.1` went to `second`).
    ///
    /// # Safety
    /// Both ranges must be valid for writes of their lengths for the duration of the call.
    pub unsafe fn recv_two_raw(
        &self,
        first: (*mut u8, usize),
        second: (*mut u8, usize),
    ) -> io::Result<usize> {
        let mut iov = [
            libc::iovec {
                iov_base: first.0.cast(),
                iov_len: first.1,
            },
            libc::iovec {
                iov_base: second.0.cast(),
                iov_len: second.1,
            },
        ];
        // SAFETY: msghdr is plain data; zeroed is a valid "no name, no control" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        // SAFETY: msg points at two iovecs whose buffers the caller guarantees writable; fd is an
        // open socket.
        let rc = unsafe { libc::recvmsg(self.fd(), &mut msg, libc::MSG_DONTWAIT) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc as usize)
        }
    }

    /// Sends from up to 64 `(pointer, length)` segments without blocking; returns bytes sent.
    ///
    /// # Safety
    /// Every segment must be valid for reads of its length for the duration of the call.
    pub unsafe fn send_raw(&self, segments: &[(*const u8, usize)]) -> io::Result<usize> {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 64];
        let n = segments.len().min(iov.len());
        for (slot, &(ptr, len)) in iov.iter_mut().zip(&segments[..n]) {
            slot.iov_base = ptr as *mut libc::c_void;
            slot.iov_len = len;
        }
        // SAFETY: msghdr is plain data; zeroed is a valid "no name, no control" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n as _;
        // SAFETY: msg points at n initialised iovecs whose buffers the caller guarantees readable;
        // MSG_NOSIGNAL turns a closed peer into EPIPE instead of SIGPIPE.
        let rc = unsafe { libc::sendmsg(self.fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc as usize)
        }
    }

    /// Reads exactly `buf.len()` bytes. While nothing has been read yet, waits up to `idle`
    /// (`None`: forever); once a byte arrived, the rest must come within `timeout`.
    pub fn read_exact(
        &self,
        buf: &mut [u8],
        idle: Option<Duration>,
        timeout: Duration,
        stop: &AtomicBool,
    ) -> Result<(), IoFail> {
        let mut done = 0;
        while done < buf.len() {
            // SAFETY: buf[done..] is a valid, exclusively borrowed byte range.
            let rc = unsafe { self.recv_raw(buf[done..].as_mut_ptr(), buf.len() - done) };
            match rc {
                Ok(0) if done == 0 => return Err(IoFail::Closed),
                Ok(0) => return Err(IoFail::Eof),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let limit = if done == 0 { idle } else { Some(timeout) };
                    self.wait(Readiness::Read, limit, stop)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(IoFail::Os(e)),
            }
        }
        Ok(())
    }

    /// Writes all of `buf`, failing if the peer stops reading for `timeout`.
    pub fn write_all(
        &self,
        buf: &[u8],
        timeout: Duration,
        stop: &AtomicBool,
    ) -> Result<(), IoFail> {
        let mut done = 0;
        while done < buf.len() {
            // SAFETY: buf[done..] is a valid borrowed byte range.
            let rc = unsafe { self.send_raw(&[(buf[done..].as_ptr(), buf.len() - done)]) };
            match rc {
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait(Readiness::Write, Some(timeout), stop)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(IoFail::Os(e)),
            }
        }
        Ok(())
    }
}

/// Sets one integer socket option.
fn set_int_option(fd: RawFd, level: libc::c_int, opt: libc::c_int, value: usize) -> io::Result<()> {
    let value = value.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: value is a live c_int and its size is passed; fd is an open socket.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets `SO_SNDBUF` and `SO_RCVBUF` (the kernel caps them at `net.core.*mem_max`); 0 keeps a
/// default, which on Linux also keeps that buffer's autotuning.
pub fn set_buffer_sizes(stream: &TcpStream, send: usize, receive: usize) -> io::Result<()> {
    for (opt, bytes) in [(libc::SO_SNDBUF, send), (libc::SO_RCVBUF, receive)] {
        if bytes > 0 {
            set_int_option(stream.as_raw_fd(), libc::SOL_SOCKET, opt, bytes)?;
        }
    }
    Ok(())
}

/// A socket address as the C calls take it.
fn raw_sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data, so zeroed is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and aligned for every sockaddr.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and aligned for every sockaddr.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// Connects to `remote` from the local address `local` (the kernel picks the port), giving up
/// after `timeout`. Binding first is what puts a lane on one NIC of a host with several.
pub fn connect_from(local: IpAddr, remote: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    if local.is_ipv4() != remote.is_ipv4() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("local address {local} and peer address {remote} are of different families"),
        ));
    }
    let family = if remote.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a freshly created socket that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let (local_raw, local_len) = raw_sockaddr(SocketAddr::new(local, 0));
    // SAFETY: local_raw is a live sockaddr of local_len bytes; fd is an open socket.
    let rc = unsafe {
        libc::bind(
            fd,
            (&local_raw as *const libc::sockaddr_storage).cast(),
            local_len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let (remote_raw, remote_len) = raw_sockaddr(remote);
    // SAFETY: remote_raw is a live sockaddr of remote_len bytes; fd is an open socket.
    let rc = unsafe {
        libc::connect(
            fd,
            (&remote_raw as *const libc::sockaddr_storage).cast(),
            remote_len,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        let never = AtomicBool::new(false);
        match wait_fd(fd, Readiness::Write, Some(timeout), &never) {
            Ok(()) => {}
            Err(IoFail::TimedOut) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no answer within {timeout:?}"),
                ));
            }
            Err(IoFail::Os(e)) => return Err(e),
            Err(other) => return Err(io::Error::other(other.to_string())),
        }
        let mut err: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: err is a live c_int of `len` bytes; fd is an open socket.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut err as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        if err != 0 {
            return Err(io::Error::from_raw_os_error(err));
        }
    }
    let stream = TcpStream::from(owned);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Sets `SO_LINGER` to {on, 0}: closing the socket (also by the kernel, when the process dies)
/// resets the connection and discards its send queue instead of delivering what is queued.
pub fn set_linger_abort(stream: &TcpStream) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: linger is a live libc::linger and its size is passed; fd is an open socket.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
