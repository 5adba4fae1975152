//! The agent's `GET /openapi.json` documents every route the agent serves.

mod common;

use common::World;
use serde_json::json;
use std::collections::BTreeSet;

/// Every route of the agent's router, as (method, path). The test compares
/// this list with the document and calls each route, so a documented route
/// the agent does not serve, or a served one missing from the document (once
/// listed here), fails.
const ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/acquire"),
    ("post", "/v1/permits/{permit_id}/renew"),
    ("post", "/v1/permits/{permit_id}/release"),
    ("get", "/v1/status"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_documents_exactly_the_agent_routes_and_each_is_served() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 100, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;

    let doc = a.http.get("/openapi.json").await.expect(200).body;
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "{doc}");
    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .flat_map(|(path, ops)| {
            ops.as_object().unwrap().keys().map(move |m| (m.clone(), path.clone())).collect::<Vec<_>>()
        })
        .collect();
    let expected: BTreeSet<(String, String)> =
        ROUTES.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
    assert_eq!(documented, expected);
    // The acquire answers are typed: their schemas come from the structs
    // the handler serializes, and the 200 names the fields it sends.
    let responses = &doc["paths"]["/v1/acquire"]["post"]["responses"];
    let schema_of = |status: &str| responses[status]["content"]["application/json"]["schema"]["$ref"].clone();
    assert_eq!(schema_of("200"), json!("#/components/schemas/Admitted"), "{responses}");
    assert_eq!(schema_of("429"), json!("#/components/schemas/ErrorAnswer"), "{responses}");
    let admitted = &doc["components"]["schemas"]["Admitted"]["properties"];
    for field in ["allowed", "source", "window_start", "remaining", "key_remaining", "results"] {
        assert!(admitted.get(field).is_some(), "Admitted lacks {field}: {admitted}");
    }
    let admit =
        a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "read"})).await.expect(200).body;
    for field in admit.as_object().unwrap().keys() {
        assert!(admitted.get(field).is_some(), "the answer's {field} is not in the schema: {admit}");
    }

    // A permit of a concurrency quota for the permit routes.
    w.policy("atlas", "jobs", json!({"kind": "concurrency", "max_in_flight": 2})).await;
    let permit =
        a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "jobs"})).await.expect(200).body;
    for field in permit.as_object().unwrap().keys() {
        assert!(admitted.get(field).is_some(), "the answer's {field} is not in the schema: {permit}");
    }
    let permit_id = permit["permit_id"].as_str().expect("permit_id");
    for (method, path) in ROUTES {
        let r = match *method {
            "post" if path.starts_with("/v1/permits") => {
                a.http.post(&path.replace("{permit_id}", permit_id), &json!({})).await
            }
            "post" => a.http.post(path, &json!({"tenant": "atlas", "resource": "read"})).await,
            _ => a.http.get(path).await,
        };
        assert_ne!(r.error(), "not_found", "{method} {path} is not served: {}", r.body);
        assert_eq!(r.status, 200, "{method} {path}: {}", r.body);
    }
    assert_eq!(a.http.get("/v1/nothing").await.error(), "not_found", "the fallback answers not_found");
}
