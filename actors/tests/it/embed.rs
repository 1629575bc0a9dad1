//! The embedding example, run as a test: an application actor embeds a
//! cluster on the fake provider, a sibling actor applies two shapes, and an
//! iroh telemetry subscriber on loopback sees both generations converge.

// The policy binds the library; a test owns its runtime and real time (iroh).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

#[path = "../../examples/cluster.rs"]
mod example;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_cluster_converges_two_generations_applied_by_a_sibling_actor() {
    let converged = example::run().await.expect("the example runs");
    assert_eq!(converged, [(1, 3), (2, 5)]);
}
