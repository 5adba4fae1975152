//! An accepted stream for a server that owns its connections (tonic's
//! gRPC server): it holds its slot of the bound until dropped, and fails
//! its reads (so the server closes it) when the client has not sent the
//! HTTP/2 connection preface within the header read timeout or has sent
//! nothing for the idle timeout.

use super::slots::{Admit, Slot, Slots};
use super::{Limits, Reason};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::Sleep;

/// Length of the HTTP/2 client connection preface
/// (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE: usize = 24;

/// A stream within the limits of its listener.
pub struct Guarded<IO> {
    io: IO,
    slot: Slot,
    limits: Limits,
    accepted: Instant,
    /// Bytes read so far, counted up to the preface's length.
    first: usize,
    last_read: Instant,
    timer: Pin<Box<Sleep>>,
}

impl<IO> Guarded<IO> {
    /// Takes a slot for `io`, or `None` (the stream is dropped, so closed)
    /// when the bound is reached.
    pub fn admit(io: IO, slots: &std::sync::Arc<Slots>, limits: Limits) -> Option<Guarded<IO>> {
        let slot = match slots.admit() {
            Admit::Serve(s) | Admit::ProbesOnly(s) => s,
            Admit::Refuse => return None,
        };
        let now = Instant::now();
        Some(Guarded {
            io,
            slot,
            limits,
            accepted: now,
            first: 0,
            last_read: now,
            timer: Box::pin(tokio::time::sleep_until((now + limits.header_read_timeout).into())),
        })
    }

    /// The inner stream.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    fn deadline(&self) -> (Instant, Reason) {
        if self.first < PREFACE {
            (self.accepted + self.limits.header_read_timeout, Reason::HeaderTimeout)
        } else {
            (self.last_read + self.limits.idle_timeout, Reason::Idle)
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Pending => {}
            ready => {
                let n = buf.filled().len() - before;
                if n > 0 {
                    self.first = (self.first + n).min(PREFACE);
                    self.last_read = Instant::now();
                }
                return ready;
            }
        }
        let (at, reason) = self.deadline();
        let this = &mut *self;
        if this.timer.deadline() != at.into() {
            this.timer.as_mut().reset(at.into());
        }
        match this.timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.slot.conn_closed(reason);
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, reason.label())))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

forward_async_write!(Guarded);
