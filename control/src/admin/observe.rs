//! The admin API's reports and reads: load, usage, prices, the ledger, lanes, events, actors.

use laneway_proto::admin::EventsRequest;
use laneway_proto::admin::WriteReply;
use laneway_proto::admin::{ActorsRequest, SetFailpointReply, SetFailpointRequest};
use laneway_proto::admin::{
    DocumentsReply, JobWriteReply, JobWritesReply, JobWritesRequest, LaneStatusRequest, LedgerRequest, LoadReport,
    LoadReportReply, SetPriceRequest, UsageReportRequest,
};
use tonic::{Request, Response, Status};

use super::service::*;
use super::AdminError;
use crate::command::Command;

pub(super) async fn report_load(
    admin: &AdminGrpc,
    req: Request<LoadReport>,
) -> Result<Response<LoadReportReply>, Status> {
    admin.leader_only()?;
    // The reporting controller (or router) is the one its certificate names, whatever the
    // message says.
    let certified = crate::auth::caller(&req).map(|id| (id.to_string(), id.reporter_id()));
    let r = req.into_inner();
    if let Some((who, reporter)) = certified.filter(|(_, c)| *c != Some(r.controller_id)) {
        return Err(Status::permission_denied(format!(
            "this load report speaks for reporter {} but came with the certificate of {who} (reporter {}); a controller or router reports only its own load",
            r.controller_id,
            reporter.map_or("none".into(), |c| c.to_string())
        )));
    }
    let load = r
        .models
        .into_iter()
        .map(|l| {
            (
                l.model,
                crate::scheduler::autoscale::ModelLoad {
                    in_flight: l.in_flight,
                    waiting: l.waiting,
                    ttft_p99_ms: (l.ttft_p99_ms > 0.0).then_some(l.ttft_p99_ms),
                    ..Default::default()
                },
            )
        })
        .collect();
    admin.load.record(r.controller_id, load, tokio::time::Instant::now());
    // A follower's actor restarts, for this leader's events (bounded: a report carries
    // what one controller's actors did in half a second).
    for e in r
        .actor_events
        .iter()
        .take(crate::scheduler::load_reporter::MAX_EVENTS_PER_REPORT)
    {
        let actor: String = e.actor.chars().take(128).collect();
        let message: String = e.message.chars().take(512).collect();
        admin.history.event(
            "actor",
            &format!("controller {}/{actor}", r.controller_id),
            format!("failed and restarted: {message}"),
        );
    }
    Ok(Response::new(LoadReportReply {}))
}

pub(super) async fn actors(admin: &AdminGrpc, req: Request<ActorsRequest>) -> Result<Response<DocumentsReply>, Status> {
    let node = req.into_inner().node;
    let docs: Vec<String> = if node.is_empty() {
        crate::actors::documents(&format!("controller {}", admin.node_id), admin.actors.snapshot())
    } else {
        admin.leader_only()?;
        let seen = admin.heartbeats.get(&node).ok_or_else(|| {
            Status::not_found(format!(
                "no heartbeat from node {node:?} reached this leader; is its agent connected? (`lanectl node list` shows when each node was last heard)"
            ))
        })?;
        crate::actors::documents(&format!("agent {node}"), seen.actors)
    };
    Ok(Response::new(DocumentsReply {
        json: docs,
        applied_index: admin.sm.applied_index(),
    }))
}

/// The `SetFailpoint` name that jumps the controller's wall clock by its actions' milliseconds.
pub const CLOCK_OFFSET: &str = "clock::offset_ms";

pub(super) async fn set_failpoint(
    admin: &AdminGrpc,
    req: Request<SetFailpointRequest>,
) -> Result<Response<SetFailpointReply>, Status> {
    admin.audited("set_failpoint", super::audit::Caller::of(&req), async move {
        let r = req.into_inner();
        if !fail::has_failpoints() {
            return Err(Status::failed_precondition(
                "this controller was built without failpoints (a release build); failpoints are for the chaos harness, on a build with `--features laneway-control/testing`",
            ));
        }
        // Not a failpoint of the fail crate: a jump of this controller's wall clock.
        if r.name == CLOCK_OFFSET {
            let ms = match r.actions.trim() {
                "off" | "" => 0,
                n => n.parse::<i64>().map_err(|e| {
                    Status::invalid_argument(format!(
                        "{CLOCK_OFFSET}: {:?} is not a number of milliseconds ({e}); give e.g. `3600000`, `-60000` or `off`",
                        r.actions
                    ))
                })?,
            };
            laneway_core::clock::set_offset_ms(ms);
            tracing::warn!(offset_ms = ms, "wall clock jumped (chaos)");
            return Ok(Response::new(SetFailpointReply {}));
        }
        fail::cfg(r.name.clone(), &r.actions).map_err(|e| {
            Status::invalid_argument(format!(
                "failpoint {:?}: actions {:?}: {e}; give the fail crate's syntax, e.g. `1*return` or `off`",
                r.name, r.actions
            ))
        })?;
        tracing::warn!(failpoint = %r.name, actions = %r.actions, "failpoint set (chaos)");
        Ok(Response::new(SetFailpointReply {}))
    })
    .await
}

pub(super) async fn record_usage(
    admin: &AdminGrpc,
    req: Request<UsageReportRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin.leader_only()?;
    let certified = crate::auth::caller(&req).map(|id| (id.to_string(), id.reporter_id()));
    let mut report: crate::ledger::UsageReport = parse_document("usage report", &req.into_inner().json)?;
    // Reports are deduplicated by reporter and sequence: one speaking for another router
    // could make the ledger skip that router's real usage.
    if let Some((who, reporter)) = certified.filter(|(_, c)| *c != Some(report.reporter)) {
        return Err(Status::permission_denied(format!(
            "this usage report speaks for reporter {} but came with the certificate of {who} (reporter {}); a controller or router reports only its own usage",
            report.reporter,
            reporter.map_or("none".into(), |c| c.to_string())
        )));
    }
    // Usage is filed by the leader's clock, as its own router's is: one clock drives the
    // ledger's buckets, whatever the reporting controller's says.
    report.at_ms = crate::jobs::unix_ms();
    Ok(Response::new(admin.write(Command::RecordUsage(report)).await?))
}

pub(super) async fn set_price(
    admin: &AdminGrpc,
    req: Request<SetPriceRequest>,
) -> Result<Response<WriteReply>, Status> {
    admin
        .audited("set_price", super::audit::Caller::of(&req), async move {
            let r = req.into_inner();
            let tier = crate::ledger::Tier::parse(&r.tier).map_err(AdminError::InvalidArgument)?;
            let micros_per_hour = if r.remove {
                None
            } else {
                Some(crate::ledger::usd_to_micros(r.usd_per_hour).map_err(AdminError::InvalidArgument)?)
            };
            Ok(Response::new(
                admin
                    .write(Command::SetPrice {
                        product: r.product,
                        tier,
                        micros_per_hour,
                    })
                    .await?,
            ))
        })
        .await
}

pub(super) async fn ledger(admin: &AdminGrpc, req: Request<LedgerRequest>) -> Result<Response<DocumentsReply>, Status> {
    let r = req.into_inner();
    let by = crate::ledger::query::By::parse(if r.by.is_empty() { "lane" } else { &r.by })
        .map_err(AdminError::InvalidArgument)?;
    let window_ms = if r.window_ms == 0 {
        crate::ledger::HOUR_MS
    } else {
        r.window_ms
    };
    if window_ms > crate::ledger::HOURS_KEPT_MS {
        return Err(AdminError::OutOfRange(format!(
            "window of {} h: the ledger keeps {} days; ask for less",
            window_ms / crate::ledger::HOUR_MS,
            crate::ledger::HOURS_KEPT_MS / crate::ledger::HOUR_MS / 24
        ))
        .into());
    }
    admin.linearizable_barrier().await?;
    let applied_index = admin.sm.applied_index();
    let now = crate::jobs::unix_ms();
    let report = admin
        .sm
        .with_ledger(|l, f| crate::ledger::query::report(l, f, by, now.saturating_sub(window_ms), now));
    Ok(Response::new(DocumentsReply {
        json: vec![to_json(&report)],
        applied_index,
    }))
}

pub(super) async fn job_writes(
    admin: &AdminGrpc,
    req: Request<JobWritesRequest>,
) -> Result<Response<JobWritesReply>, Status> {
    admin.leader_only()?;
    use crate::jobs::gateway::{GatewayError, JobWrite};
    // Every write is proposed at once, so the proposer folds them into one entry.
    let replies = futures::future::join_all(req.into_inner().json.iter().map(|json| async move {
        let refused = |why: String| JobWriteReply {
            rejected: why,
            ..JobWriteReply::default()
        };
        let write: JobWrite = match parse_document("job write", json) {
            Ok(w) => w,
            Err(e) => return refused(e.to_string()),
        };
        if let Err(e) = crate::jobs::gateway::command_of(write.clone()).validate() {
            return refused(e.to_string());
        }
        match admin.jobs.commit_here(write).await {
            Ok((log_index, resp)) => JobWriteReply {
                outcome_json: resp.job.as_ref().map(to_json).unwrap_or_default(),
                rejected: resp.rejected.unwrap_or_default(),
                log_index,
                unavailable: String::new(),
            },
            Err(GatewayError::Rejected(m)) => refused(m),
            Err(GatewayError::Unavailable(m)) => JobWriteReply {
                unavailable: m,
                ..JobWriteReply::default()
            },
        }
    }))
    .await;
    Ok(Response::new(JobWritesReply { replies }))
}

pub(super) async fn lane_status(
    admin: &AdminGrpc,
    req: Request<LaneStatusRequest>,
) -> Result<Response<DocumentsReply>, Status> {
    let recent = req.into_inner().recent.min(1000) as usize;
    let docs = admin
        .router
        .lane_status()
        .into_iter()
        .map(|l| {
            let records = admin.router.recent(Some(&l.class), recent);
            to_json(&serde_json::json!({"status": l, "recent": records}))
        })
        .collect();
    Ok(Response::new(DocumentsReply {
        json: docs,
        applied_index: admin.sm.applied_index(),
    }))
}

pub(super) async fn events(admin: &AdminGrpc, req: Request<EventsRequest>) -> Result<Response<DocumentsReply>, Status> {
    admin.leader_only()?;
    let since = req.into_inner().since_ms;
    let mut events = admin.history.events_since(since);
    admin.sm.with_ledger(|l, _| {
        events.extend(
            l.events
                .iter()
                .filter(|e| e.at_ms >= since)
                .map(|e| crate::observe::history::OpsEvent {
                    at_ms: e.at_ms,
                    kind: e.kind.clone(),
                    subject: e.subject.clone(),
                    message: e.message.clone(),
                }),
        )
    });
    events.sort_by_key(|e| e.at_ms);
    Ok(Response::new(DocumentsReply {
        json: events.iter().map(to_json).collect(),
        applied_index: admin.sm.applied_index(),
    }))
}
