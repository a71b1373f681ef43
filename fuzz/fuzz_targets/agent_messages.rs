//! What an agent (perhaps a compromised one) sends: a heartbeat decoded from the wire and
//! turned into the replica records the leader would propose, which are either refused or
//! plain enough to route; and the certificates and signing requests it presents.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    if let Ok(hb) = laneway_proto::agent::Heartbeat::decode(data) {
        let records = laneway_control::agent_api::replica_records(&hb, "10.0.0.7");
        if laneway_control::registry::validate_replica_report(&records).is_ok() {
            for r in &records {
                assert!(r.endpoint.is_empty() || format!("http://{}/", r.endpoint).parse::<hyper::Uri>().is_ok());
            }
        }
    }
    let _ = laneway_pki::identity_of(data);
    let _ = laneway_pki::serial_of(data);
    let _ = laneway_pki::validity_der(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = laneway_pki::csr_key_sha256(text);
        let _ = laneway_pki::identity_of_pem(text);
    }
});
