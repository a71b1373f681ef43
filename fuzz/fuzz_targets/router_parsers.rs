//! What clients and replicas send the router: KServe bodies, job submissions, chat and
//! completion requests (and their token counts), event streams cut anywhere, and the result
//! cache's key. The first byte picks the parser.
#![no_main]

use laneway_control::router::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 5 {
        0 => fuzzing::kserve_body(rest),
        1 => fuzzing::job_submission(rest),
        2 => fuzzing::completion(rest),
        3 => {
            let cut = rest.first().map_or(0, |b| *b as usize);
            fuzzing::sse(rest, cut);
        }
        _ => fuzzing::cache_key(rest),
    }
});
