//! The admin gRPC service: one line per RPC, each handled in the file of its area
//! (`cluster`, `registry`, `access`, `fleet`, `observe`).

use super::service::AdminGrpc;
use laneway_proto::admin::admin_service_server::AdminService;
use laneway_proto::admin::{ActorsRequest, SetFailpointReply, SetFailpointRequest};
use laneway_proto::admin::{
    AddLearnerRequest, DeleteSettingRequest, GetSettingReply, GetSettingRequest, InitReply, InitRequest,
    ListNodesReply, ListNodesRequest, MembershipReply, NodeStatus, PromoteRequest, PutSettingRequest, ReadIndexReply,
    ReadIndexRequest, RemoveRequest, SetNodeFlagsRequest, SnapshotReply, SnapshotRequest, StatusRequest, WriteReply,
};
use laneway_proto::admin::{
    ApplyMigPlanRequest, AuditRequest, CreateAdminTokenRequest, CreateJoinTokenRequest, EventsRequest,
    FinalizeUpgradeReply, FinalizeUpgradeRequest, JoinTokenReply, PlanMigRequest, RevokeCertificateRequest,
    RevokeTokenRequest, SetMigLayoutRequest, SetPoolTaintsRequest, UpdateRolloutRequest,
};
use laneway_proto::admin::{
    CreateTenantRequest, DocumentsReply, JobWritesReply, JobWritesRequest, LaneStatusRequest, LedgerRequest,
    ListRegistryRequest, LoadReport, LoadReportReply, NameRequest, PutDocumentRequest, SetPriceRequest,
    SetTenantLimitRequest, TenantKeyReply, UsageReportRequest,
};
use laneway_proto::admin::{ReadJobsRequest, RoutingUpdate, WatchRoutingRequest};
use tonic::{Request, Response, Status};

#[tonic::async_trait]
impl AdminService for AdminGrpc {
    async fn init(&self, req: Request<InitRequest>) -> Result<Response<InitReply>, Status> {
        super::cluster::init(self, req).await
    }

    async fn status(&self, _req: Request<StatusRequest>) -> Result<Response<NodeStatus>, Status> {
        super::cluster::status(self, _req).await
    }

    async fn finalize_upgrade(
        &self,
        req: Request<FinalizeUpgradeRequest>,
    ) -> Result<Response<FinalizeUpgradeReply>, Status> {
        super::cluster::finalize_upgrade(self, req).await
    }

    async fn add_learner(&self, req: Request<AddLearnerRequest>) -> Result<Response<MembershipReply>, Status> {
        super::cluster::add_learner(self, req).await
    }

    async fn promote(&self, req: Request<PromoteRequest>) -> Result<Response<MembershipReply>, Status> {
        super::cluster::promote(self, req).await
    }

    async fn remove(&self, req: Request<RemoveRequest>) -> Result<Response<MembershipReply>, Status> {
        super::cluster::remove(self, req).await
    }

    async fn put_setting(&self, req: Request<PutSettingRequest>) -> Result<Response<WriteReply>, Status> {
        super::cluster::put_setting(self, req).await
    }

    async fn delete_setting(&self, req: Request<DeleteSettingRequest>) -> Result<Response<WriteReply>, Status> {
        super::cluster::delete_setting(self, req).await
    }

    async fn put_class(&self, req: Request<PutDocumentRequest>) -> Result<Response<WriteReply>, Status> {
        super::registry::put_class(self, req).await
    }

    async fn put_model(&self, req: Request<PutDocumentRequest>) -> Result<Response<WriteReply>, Status> {
        super::registry::put_model(self, req).await
    }

    async fn deploy_model(&self, req: Request<PutDocumentRequest>) -> Result<Response<WriteReply>, Status> {
        super::registry::deploy_model(self, req).await
    }

    async fn start_rollout(&self, req: Request<PutDocumentRequest>) -> Result<Response<WriteReply>, Status> {
        super::registry::start_rollout(self, req).await
    }

    async fn update_rollout(&self, req: Request<UpdateRolloutRequest>) -> Result<Response<WriteReply>, Status> {
        super::registry::update_rollout(self, req).await
    }

    async fn remove_model(&self, req: Request<NameRequest>) -> Result<Response<WriteReply>, Status> {
        super::registry::remove_model(self, req).await
    }

    async fn list_registry(&self, req: Request<ListRegistryRequest>) -> Result<Response<DocumentsReply>, Status> {
        super::registry::list_registry(self, req).await
    }

    async fn create_tenant(&self, req: Request<CreateTenantRequest>) -> Result<Response<TenantKeyReply>, Status> {
        super::registry::create_tenant(self, req).await
    }

    async fn create_join_token(
        &self,
        req: Request<CreateJoinTokenRequest>,
    ) -> Result<Response<JoinTokenReply>, Status> {
        super::access::create_join_token(self, req).await
    }

    async fn revoke_token(&self, req: Request<RevokeTokenRequest>) -> Result<Response<WriteReply>, Status> {
        super::access::revoke_token(self, req).await
    }

    async fn create_admin_token(
        &self,
        req: Request<CreateAdminTokenRequest>,
    ) -> Result<Response<JoinTokenReply>, Status> {
        super::access::create_admin_token(self, req).await
    }

    async fn revoke_certificate(&self, req: Request<RevokeCertificateRequest>) -> Result<Response<WriteReply>, Status> {
        super::access::revoke_certificate(self, req).await
    }

    async fn rotate_tenant_key(&self, req: Request<NameRequest>) -> Result<Response<TenantKeyReply>, Status> {
        super::registry::rotate_tenant_key(self, req).await
    }

    async fn set_tenant_limit(&self, req: Request<SetTenantLimitRequest>) -> Result<Response<WriteReply>, Status> {
        super::registry::set_tenant_limit(self, req).await
    }

    async fn report_load(&self, req: Request<LoadReport>) -> Result<Response<LoadReportReply>, Status> {
        super::observe::report_load(self, req).await
    }

    async fn actors(&self, req: Request<ActorsRequest>) -> Result<Response<DocumentsReply>, Status> {
        super::observe::actors(self, req).await
    }

    async fn set_failpoint(&self, req: Request<SetFailpointRequest>) -> Result<Response<SetFailpointReply>, Status> {
        super::observe::set_failpoint(self, req).await
    }

    type WatchRoutingStream = tokio_stream::wrappers::ReceiverStream<Result<RoutingUpdate, Status>>;

    async fn watch_routing(
        &self,
        req: Request<WatchRoutingRequest>,
    ) -> Result<Response<Self::WatchRoutingStream>, Status> {
        crate::router_feed::watch(&self.ctx, req).await.map(Response::new)
    }

    async fn read_jobs(&self, req: Request<ReadJobsRequest>) -> Result<Response<DocumentsReply>, Status> {
        let applied_index = self.sm.applied_index();
        let json = crate::router_feed::read_jobs(&self.ctx, req).await?;
        Ok(Response::new(DocumentsReply { json, applied_index }))
    }

    async fn record_usage(&self, req: Request<UsageReportRequest>) -> Result<Response<WriteReply>, Status> {
        super::observe::record_usage(self, req).await
    }

    async fn set_price(&self, req: Request<SetPriceRequest>) -> Result<Response<WriteReply>, Status> {
        super::observe::set_price(self, req).await
    }

    async fn ledger(&self, req: Request<LedgerRequest>) -> Result<Response<DocumentsReply>, Status> {
        super::observe::ledger(self, req).await
    }

    async fn job_writes(&self, req: Request<JobWritesRequest>) -> Result<Response<JobWritesReply>, Status> {
        super::observe::job_writes(self, req).await
    }

    async fn lane_status(&self, req: Request<LaneStatusRequest>) -> Result<Response<DocumentsReply>, Status> {
        super::observe::lane_status(self, req).await
    }

    async fn get_setting(&self, req: Request<GetSettingRequest>) -> Result<Response<GetSettingReply>, Status> {
        super::cluster::get_setting(self, req).await
    }

    async fn snapshot(&self, req: Request<SnapshotRequest>) -> Result<Response<SnapshotReply>, Status> {
        super::cluster::snapshot(self, req).await
    }

    async fn read_index(&self, _req: Request<ReadIndexRequest>) -> Result<Response<ReadIndexReply>, Status> {
        super::cluster::read_index(self, _req).await
    }

    async fn set_pool_taints(&self, req: Request<SetPoolTaintsRequest>) -> Result<Response<WriteReply>, Status> {
        super::fleet::set_pool_taints(self, req).await
    }

    async fn events(&self, req: Request<EventsRequest>) -> Result<Response<DocumentsReply>, Status> {
        super::observe::events(self, req).await
    }

    async fn set_mig_layout(&self, req: Request<SetMigLayoutRequest>) -> Result<Response<WriteReply>, Status> {
        super::fleet::set_mig_layout(self, req).await
    }

    async fn plan_mig(&self, req: Request<PlanMigRequest>) -> Result<Response<DocumentsReply>, Status> {
        super::fleet::plan_mig(self, req).await
    }

    async fn show_mig_plan(&self, _req: Request<PlanMigRequest>) -> Result<Response<DocumentsReply>, Status> {
        super::fleet::show_mig_plan(self, _req).await
    }

    async fn apply_mig_plan(&self, req: Request<ApplyMigPlanRequest>) -> Result<Response<WriteReply>, Status> {
        super::fleet::apply_mig_plan(self, req).await
    }

    async fn list_nodes(&self, _req: Request<ListNodesRequest>) -> Result<Response<ListNodesReply>, Status> {
        super::fleet::list_nodes(self, _req).await
    }

    async fn audit(&self, req: Request<AuditRequest>) -> Result<Response<DocumentsReply>, Status> {
        super::access::audit(self, req).await
    }

    async fn set_node_flags(&self, req: Request<SetNodeFlagsRequest>) -> Result<Response<WriteReply>, Status> {
        super::fleet::set_node_flags(self, req).await
    }
}
