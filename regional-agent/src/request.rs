//! The request model of an admission decision, shared by `POST
//! /v1/acquire` ([`crate::acquire`]) and Envoy's rate limit service
//! ([`crate::rls`]): what a valid request asks ([`Acquire`]), and what the
//! decision answers ([`Decided`], one [`Paid`] per quota, or a
//! [`Refused`]). Plain data and pure rules; the decision itself is made in
//! [`crate::spend`].

use crate::error::Error;
use crate::quotas::PolicyInfo;
use crate::scripts::Admit;
use serde::Deserialize;

/// Largest `cost` accepted before the policy is known.
pub const MAX_COST: i64 = 1_000_000_000;

/// Longest `request_id` accepted.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Longest `key` (the principal of a per-key limit) accepted.
pub const MAX_KEY_LEN: usize = 128;

fn one() -> i64 {
    1
}

/// Most quotas one request may name.
pub const MAX_RESOURCES: usize = 8;

/// One quota of a request that names several (`resources`).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourceCost {
    pub resource: String,
    /// Default 1; `null` is the same as leaving it out, as in the single
    /// form's `cost`.
    #[serde(default = "one", deserialize_with = "null_is_one")]
    #[schema(nullable, default = 1)]
    pub cost: i64,
}

/// `cost` absent or `null`: 1 (the one rule of both request forms).
fn null_is_one<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<i64, D::Error> {
    Ok(<Option<i64> as serde::Deserialize>::deserialize(d)?.unwrap_or(1))
}

/// A valid acquire: the quotas it spends, in the request's order.
#[derive(Debug, Clone)]
pub struct Acquire {
    pub tenant: String,
    pub wants: Vec<ResourceCost>,
    /// Whether the request used the `resources` form (its answer lists
    /// each quota).
    pub multi: bool,
    pub request_id: Option<String>,
    pub key: Option<String>,
    /// 0 (most important) to 4 (shed first, see [`crate::shed`]).
    pub priority: u8,
}

impl Acquire {
    /// The field a problem with quota `i`'s cost or key is named by.
    pub(crate) fn field(&self, single: &'static str) -> &'static str {
        if self.multi {
            "resources"
        } else {
            single
        }
    }

    /// The request id claim's value: what the id stands for.
    pub(crate) fn claim(&self) -> String {
        let mut v = self.wants.iter().map(|w| format!("{}:{}:{}", w.resource.len(), w.resource, w.cost));
        let mut s = v.next().unwrap_or_default();
        for w in v {
            s.push('+');
            s.push_str(&w);
        }
        // The key joins the claim only when given, so a claim written
        // before per-key limits existed still matches its keyless repeat.
        if let Some(k) = &self.key {
            s.push_str(&format!(":{}:{k}", k.len()));
        }
        s
    }
}

/// Whether `s` is 1 to `max` visible ASCII characters (no space, no control).
pub(crate) fn visible_ascii(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.chars().all(|c| c.is_ascii_graphic())
}

/// The check of a request's `key` (the principal), the same on every
/// route that takes one: 1 to [`MAX_KEY_LEN`] visible ASCII characters.
pub(crate) fn check_key(k: &str) -> Result<(), Error> {
    if visible_ascii(k, MAX_KEY_LEN) {
        Ok(())
    } else {
        Err(Error::invalid("key", format!("must be 1 to {MAX_KEY_LEN} visible ASCII characters")))
    }
}

/// The limit a shadow-mode policy would have refused with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shadow {
    /// The key's bucket was short (`429 per_key_limited` if enforced).
    PerKey,
    /// The quota's pool was empty (`429 quota_exhausted` if enforced).
    Quota,
    /// What was left was reserved for more important priorities (`429
    /// quota_exhausted`, `limit: "reserve"` if enforced).
    Reserve,
}

impl Shadow {
    /// The `limit` an enforced policy's 429 would name.
    pub fn limit(self, resource: &str) -> &str {
        match self {
            Shadow::PerKey => "per_key",
            Shadow::Quota => resource,
            Shadow::Reserve => "reserve",
        }
    }

    /// The refusal a shadow-mode policy turns into an admit, if `e` is one:
    /// only the 429s (a 503 is no decision, and a shadow policy cannot
    /// decide either).
    pub fn of(e: &Error) -> Option<Shadow> {
        match e {
            Error::KeyLimited { .. } => Some(Shadow::PerKey),
            Error::Exhausted { .. } => Some(Shadow::Quota),
            Error::Reserved { .. } => Some(Shadow::Reserve),
            _ => None,
        }
    }
}

/// One quota's part of an admit, and whether it is one only because the
/// policy is in shadow mode (then nothing was debited on that quota: its
/// decision was a refusal).
#[derive(Debug, Clone, PartialEq)]
pub struct Paid {
    pub admit: Admit,
    pub shadow: Option<Shadow>,
    /// Unleased tokens of the quota's pool in the admit's window as the
    /// allocator last said (0 when unknown): what other leases may still
    /// bring the region beyond its own balance.
    pub pool_room: i64,
}

impl Paid {
    /// The outcome label of this quota's part.
    pub fn outcome(&self) -> &'static str {
        match (&self.shadow, self.admit.source.as_str()) {
            (Some(_), _) => "shadow_refused",
            (None, "fallback") => "fallback",
            (None, _) => "lease",
        }
    }

    /// What the quota can still admit as the agent knows it: the region's
    /// balance after this admit plus what the pool held unleased at the
    /// last grant. Other regions may have taken some of that since, but it
    /// is never 0 while the pool was last known to have room (a client
    /// told `r=0` slows down for nothing).
    pub fn quota_left(&self) -> i64 {
        self.admit.remaining.max(0).saturating_add(self.pool_room)
    }

    /// What the `RateLimit` headers show of this part: what the quota can
    /// still admit ([`Paid::quota_left`]; none after a key's shadow
    /// refusal, which, as a refusal, says nothing of it) and the key's
    /// bucket.
    pub fn shown(&self) -> (Option<i64>, Option<i64>) {
        let remaining = match self.shadow {
            Some(Shadow::PerKey) => None,
            _ => Some(self.quota_left()),
        };
        (remaining, self.admit.key_remaining)
    }
}

/// What the `RateLimit` headers show after refusal `e`: a key's refusal
/// says nothing of the quota's balance (they describe the key's bucket);
/// any other refusal shows the quota empty.
pub fn refusal_shown(e: &Error) -> (Option<i64>, Option<i64>) {
    match e {
        Error::KeyLimited { remaining, .. } => (None, Some(*remaining)),
        _ => (Some(0), None),
    }
}

/// An admit: one part per quota of the request, in its order.
#[derive(Debug, Clone, PartialEq)]
pub struct Decided {
    pub parts: Vec<Paid>,
}

impl Decided {
    /// The part whose most restrictive limit (its pool or its key's
    /// bucket) has the fewest units left: the one the headers describe.
    /// `name(i)` is part `i`'s `<tenant>/<resource>`.
    pub fn tightest(
        &self,
        name: impl Fn(usize) -> String,
        policies: &[PolicyInfo],
        now: chrono::DateTime<chrono::Utc>,
    ) -> usize {
        (0..self.parts.len())
            .min_by_key(|&i| {
                let (r, k) = self.parts[i].shown();
                crate::headers::header_limit(&name(i), policies.get(i).copied(), r, k, now).r
            })
            .unwrap_or(0)
    }
}

/// A refusal, and the index of the quota that refused (none when the
/// agent could not decide for all of them, or before any was looked at).
pub type Refused = (Error, Option<usize>);
