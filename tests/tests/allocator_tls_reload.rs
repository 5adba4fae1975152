//! The allocator's certificate is replaced while it serves: new
//! connections get the new certificate within the poll interval, and no
//! handshake fails while the files are swapped (DESIGN §5 Security).

use quota_tests::app::{Options, TestAllocator, TlsFiles};
use quota_tests::http::Http;
use quota_tests::pg::TestDb;
use quota_tests::tls::{client_config, served_cert, write, Ca};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapped_certificate_files_are_served_to_new_connections_without_refusals() {
    let ca = Ca::new("reload root");
    let old = ca.server("allocator-old", 1001);
    let new = ca.server("allocator-new", 2002);
    assert_ne!(old.der, new.der);
    let dir = tempfile::tempdir().expect("dir");
    let files = TlsFiles {
        cert: write(dir.path(), "server.pem", &old.cert_pem),
        key: write(dir.path(), "server.key", &old.key_pem),
        client_ca: None,
    };
    let db = TestDb::start().await;
    let alloc = TestAllocator::spawn_with(&db.url, Options { tls: Some(files), ..Default::default() }).await;
    let addr = alloc.base.trim_start_matches("https://").to_string();
    let config = Arc::new(client_config(std::slice::from_ref(&ca.der)));
    assert_eq!(served_cert(&addr, config.clone()).await.expect("handshake"), old.der);
    let http = Http::with_ca(&alloc.base, &ca.cert_pem);
    assert_eq!(http.get_status("/healthz").await, Some(200));

    // New connections, back to back, for the whole swap.
    let stop = Arc::new(AtomicBool::new(false));
    let handshakes = Arc::new(AtomicU64::new(0));
    let prober = {
        let (stop, handshakes, addr, config) =
            (stop.clone(), handshakes.clone(), addr.clone(), config.clone());
        tokio::spawn(async move {
            let mut failures = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                match served_cert(&addr, config.clone()).await {
                    Ok(_) => {
                        handshakes.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => failures.push(e),
                }
            }
            failures
        })
    };
    quota_tests::wait::until("probes running", Duration::from_secs(5), || {
        let h = handshakes.clone();
        async move { (h.load(Ordering::SeqCst) > 5).then_some(()) }
    })
    .await;

    // Key first, then certificate, each an atomic rename: for a moment the
    // key does not match the certificate; that version is not applied and
    // the old one keeps serving.
    write(dir.path(), "server.key", &new.key_pem);
    write(dir.path(), "server.pem", &new.cert_pem);
    quota_tests::wait::until("the new certificate is served", Duration::from_secs(10), || {
        let (addr, config, want) = (addr.clone(), config.clone(), new.der.clone());
        async move { (served_cert(&addr, config).await.ok()? == want).then_some(()) }
    })
    .await;
    let before = handshakes.load(Ordering::SeqCst);
    quota_tests::wait::until("more probes after the swap", Duration::from_secs(5), || {
        let h = handshakes.clone();
        async move { (h.load(Ordering::SeqCst) > before + 5).then_some(()) }
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let failures = prober.await.expect("prober");
    assert!(failures.is_empty(), "handshakes failed during the swap: {failures:?}");
    // Plain requests still work over the new certificate.
    assert_eq!(Http::with_ca(&alloc.base, &ca.cert_pem).get_status("/healthz").await, Some(200));
    alloc.stop().await;
}
