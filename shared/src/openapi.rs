//! What both services' OpenAPI documents share (feature `service`).

use utoipa::Modify;

/// DESIGN §5's identifier rule on every parameter and schema property that
/// names a tenant, resource, region or agent (what both services enforce
/// with a 422), so clients and fuzzers see the constraint the server applies.
pub struct IdentifierPatterns;

/// The identifier rule as a JSON Schema pattern.
pub const ID_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$";

impl Modify for IdentifierPatterns {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{RefOr, Schema};
        const NAMES: [&str; 4] = ["tenant", "resource", "region", "agent"];
        fn constrain(schema: &mut RefOr<Schema>) {
            if let RefOr::T(Schema::Object(o)) = schema {
                o.pattern = Some(ID_PATTERN.to_string());
                o.max_length = Some(crate::ids::MAX_ID_LEN);
            }
        }
        for item in openapi.paths.paths.values_mut() {
            let ops = [&mut item.get, &mut item.post, &mut item.put, &mut item.patch, &mut item.delete];
            for op in ops.into_iter().flatten() {
                for p in op.parameters.iter_mut().flatten() {
                    if NAMES.contains(&p.name.as_str()) {
                        if let Some(s) = p.schema.as_mut() {
                            constrain(s);
                        }
                    }
                }
            }
        }
        if let Some(components) = openapi.components.as_mut() {
            for schema in components.schemas.values_mut() {
                if let RefOr::T(Schema::Object(o)) = schema {
                    for (name, prop) in o.properties.iter_mut() {
                        if NAMES.contains(&name.as_str()) {
                            constrain(prop);
                        }
                    }
                }
            }
        }
    }
}
