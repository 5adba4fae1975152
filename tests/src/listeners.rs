//! Clients that misbehave at the connection level, for the listener limit
//! tests of both services: one that sends its headers a byte at a time,
//! crowds of idle connections (some with half a request head), and a
//! probe client that opens a new connection for every request.

use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A request head that is never finished (no blank line).
pub const PARTIAL_HEAD: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ";

/// What a slow client saw.
#[derive(Debug)]
pub struct SlowEnd {
    /// From connecting to the server's first answer byte or its close.
    pub after: Duration,
    /// The answer's status line, if it answered before closing.
    pub answer: Option<String>,
}

/// Connects to `addr` and sends a request head one byte every `every`;
/// answers when the server closed the connection, or `None` if it was
/// still open after `give_up` (a head never finished gets no answer).
pub async fn slow_headers(addr: &str, every: Duration, give_up: Duration) -> Option<Duration> {
    let end = slow_request(addr, b"", PARTIAL_HEAD, every, give_up).await?;
    assert_eq!(end.answer, None, "a head never finished was answered");
    Some(end.after)
}

/// Connects to `addr`, sends `head` at once, then `drip` (then filler) one
/// byte every `every`; answers what the server did first (answer or
/// close), or `None` if it did neither within `give_up`.
pub async fn slow_request(
    addr: &str,
    head: &[u8],
    drip: &'static [u8],
    every: Duration,
    give_up: Duration,
) -> Option<SlowEnd> {
    let started = Instant::now();
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    wr.write_all(head).await.expect("head");
    let writer = tokio::spawn(async move {
        for b in drip.iter().chain(b"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".iter().cycle()) {
            if wr.write_all(&[*b]).await.is_err() {
                return;
            }
            // The client's pace, not a wait for the server.
            tokio::time::sleep(every).await;
        }
    });
    let mut buf = [0u8; 256];
    let read = tokio::time::timeout(give_up, rd.read(&mut buf)).await;
    writer.abort();
    let after = started.elapsed();
    match read {
        Ok(Ok(0) | Err(_)) => Some(SlowEnd { after, answer: None }),
        Ok(Ok(n)) => {
            let text = String::from_utf8_lossy(&buf[..n]);
            Some(SlowEnd { after, answer: text.lines().next().map(str::to_string) })
        }
        Err(_) => None,
    }
}

/// Opens up to `n` connections to `addr` one after the other (each
/// connect within 2 s), every other one sending half a request head;
/// answers those that connected.
pub async fn crowd(addr: &str, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let Ok(Ok(mut s)) = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await
        else {
            continue;
        };
        if i % 2 == 1 {
            let _ = s.write_all(PARTIAL_HEAD).await;
        }
        held.push(s);
    }
    held
}

/// How many of `conns` the server has closed (a read gives end of file or
/// an error; open ones give nothing within a few milliseconds).
pub async fn closed_count(conns: &mut [TcpStream]) -> usize {
    let mut closed = 0;
    let mut buf = [0u8; 64];
    for c in conns.iter_mut() {
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(2), c.read(&mut buf)).await {
            if matches!(r, Ok(0) | Err(_)) {
                closed += 1;
            }
        }
    }
    closed
}

/// A client that opens a new connection for every request (no pool), with
/// a 2 s timeout: each probe needs the listener to accept anew.
pub fn fresh_client() -> reqwest::Client {
    crate::http::client_builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client")
}

/// The status of `GET url` on a new connection, `None` on a timeout or a
/// closed connection.
pub async fn probe(client: &reqwest::Client, url: &str) -> Option<u16> {
    client.get(url).send().await.ok().map(|r| r.status().as_u16())
}
