//! `wait_until`: the way tests wait for readiness. Needs no root.

use std::time::{Duration, Instant};

use otherix_testbed::{wait_until, Error};

#[test]
fn wait_until_times_out_with_a_message_naming_what_it_waited_for() {
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let err = wait_until("the moon to turn blue", timeout, || None::<()>).unwrap_err();
    assert!(started.elapsed() >= timeout);
    assert!(matches!(err, Error::Timeout { .. }));
    let message = err.to_string();
    assert!(message.contains("waiting for the moon to turn blue"), "{message}");
    assert!(message.contains("timed out after 300ms"), "{message}");
}

#[test]
fn wait_until_returns_the_first_value_it_is_given() {
    let mut calls = 0;
    let value = wait_until("the third call", Duration::from_secs(60), || {
        calls += 1;
        (calls == 3).then_some("third")
    })
    .unwrap();
    assert_eq!((value, calls), ("third", 3));
}
