//! One run of the spend script (`lua/spend.lua`) for a batch of asks on
//! one quota or several, settled before its answers go out: each quota
//! adopts the token the run saw, and a loss (a changed incarnation, an
//! epoch fence) is handled on the quota it names. [`crate::spend`] asks
//! for runs, directly for a decision over several quotas and through
//! [`crate::batch`] (with [`QuotaRuns`]) for one quota's coalesced requests,
//! so that a decision's path goes down spend → batch → spend_run → scripts and
//! never back up.

use crate::app::Decider;
use crate::batch;
use crate::quotas::Quota;
use crate::scripts::{self, Ask, Caller, Common, On, Outcome, Part};
use std::sync::Arc;

/// The runs of one quota's batches, as [`batch::spend`] starts them.
pub(crate) struct QuotaRuns {
    app: Arc<Decider>,
    q: Arc<Quota>,
}

impl QuotaRuns {
    pub(crate) fn new(app: &Arc<Decider>, q: &Arc<Quota>) -> QuotaRuns {
        QuotaRuns { app: app.clone(), q: q.clone() }
    }
}

impl batch::Runner for QuotaRuns {
    async fn run(&self, common: Common, asks: Vec<Ask>) -> batch::RunAnswer {
        run(&self.app, std::slice::from_ref(&self.q), &[common], &asks).await
    }
}

/// One run of the spend script for `asks` on `quotas`, settled (each
/// quota's token adopted, a loss handled) before its answers go out.
pub(crate) async fn run(
    app: &Decider,
    quotas: &[Arc<Quota>],
    commons: &[Common],
    asks: &[Ask],
) -> batch::RunAnswer {
    app.metrics.inc("agent_spend_runs_total", &[]);
    let tokens: Vec<String> = quotas.iter().map(|q| q.token()).collect();
    let parts: Vec<Part> = quotas
        .iter()
        .zip(commons)
        .zip(&tokens)
        .map(|((q, c), t)| Part { on: On { prefix: &q.prefix, token: t }, common: *c })
        .collect();
    let by = Caller { agent: &app.settings.agent, epoch: app.ident.epoch() };
    let r = scripts::spend(&app.store.here(), by, &parts, asks).await?;
    Ok(match r {
        Outcome::Lost(l) => {
            let o = Outcome::Lost(l.clone());
            if let Some(q) = quotas.get(l.quota) {
                q.settle(&o, &app.ident, &app.metrics);
            }
            o
        }
        Outcome::Ran { value, .. } => {
            for (q, token) in quotas.iter().zip(&value.tokens) {
                q.settle(&Outcome::Ran { token: token.clone(), value: () }, &app.ident, &app.metrics);
            }
            Outcome::Ran { token: value.tokens.first().cloned().unwrap_or_default(), value: value.decisions }
        }
    })
}
