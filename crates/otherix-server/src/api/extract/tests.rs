//! The one-pass reading of request bodies held against the three-pass one
//! it replaced (kept here as the reference), and its refusals at depth.

use std::collections::BTreeMap;

use otherix_proto::agent::{
    GuestStatus, HealthReport, Heartbeat, IncomingReady, MigrationOutcome, MigrationReport, NodeRoles,
    SessionBytes, SessionEvent,
};
use otherix_proto::api::{Accelerator, CreateGrantRequest, CreateUserRequest, Health, VmState};
use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use time::OffsetDateTime;

use super::parse_object;
use crate::error::ApiError;

/// The reading this module replaced: axum's `Json` into `T`, the body again
/// into a `Value`, `T` written back, the two compared.
fn three_passes<T: DeserializeOwned + Serialize>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::Invalid("the request body must be a JSON object".into()));
    }
    let value = match axum::Json::<T>::from_bytes(bytes) {
        Ok(axum::Json(v)) => v,
        Err(rejection) => return Err(ApiError::Invalid(super::one_line(&rejection.body_text()))),
    };
    let sent: Value =
        serde_json::from_slice(bytes).map_err(|e| ApiError::Invalid(format!("invalid JSON: {e}")))?;
    let read = serde_json::to_value(&value)
        .map_err(|e| ApiError::Internal(format!("request body not serializable: {e}")))?;
    if let Some(at) = array_for_object(&sent, &read, String::new()) {
        return Err(ApiError::Invalid(format!(
            "{at}: expected a JSON object, found an array"
        )));
    }
    Ok(value)
}

fn array_for_object(sent: &Value, read: &Value, at: String) -> Option<String> {
    match (sent, read) {
        (Value::Array(_), Value::Object(_)) => Some(if at.is_empty() { "body".into() } else { at }),
        (Value::Object(sent), Value::Object(read)) => sent.iter().find_map(|(k, v)| {
            let inner = if at.is_empty() {
                k.clone()
            } else {
                format!("{at}.{k}")
            };
            read.get(k).and_then(|r| array_for_object(v, r, inner))
        }),
        (Value::Array(sent), Value::Array(read)) if sent.len() == read.len() => sent
            .iter()
            .zip(read)
            .enumerate()
            .find_map(|(i, (s, r))| array_for_object(s, r, format!("{at}[{i}]"))),
        _ => None,
    }
}

/// The refusal's message, or the body as the API read it (written back).
fn outcome<T: DeserializeOwned + Serialize>(r: Result<T, ApiError>) -> Result<Value, String> {
    match r {
        Ok(v) => Ok(serde_json::to_value(&v).unwrap()),
        Err(ApiError::Invalid(m)) => Err(m),
        Err(e) => panic!("not a 400: {e:?}"),
    }
}

fn refusal<T: DeserializeOwned + Serialize>(body: &str) -> String {
    match outcome(parse_object::<T>(body.as_bytes())) {
        Err(m) => m,
        Ok(v) => panic!("{body} was read as {v}"),
    }
}

// Shapes the request types have, and some they do not have yet.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct Outer {
    #[serde(default)]
    items: Vec<Inner>,
    #[serde(default)]
    maybe: Option<Inner>,
    #[serde(default)]
    kind: Option<Kind>,
    #[serde(default)]
    by_name: BTreeMap<String, Inner>,
    #[serde(default)]
    tagged: Vec<Tagged>,
    #[serde(default)]
    pair: Option<(u8, Inner)>,
    #[serde(default)]
    wrapped: Option<Wrapper>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct Inner {
    a: u8,
    b: String,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Wrapper(Inner);

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
enum Kind {
    Unit,
    Fields { a: u8, b: String },
    Newtype(Inner),
    Tuple(u8, u8),
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "t", deny_unknown_fields)]
enum Tagged {
    One { a: u8 },
}

#[test]
fn an_array_for_a_struct_is_refused_at_any_depth_with_its_path() {
    for (body, at) in [
        (r#"{"items":[{"a":1,"b":"x"},[2,"y"]]}"#, "items[1]"),
        (r#"{"maybe":[1,"x"]}"#, "maybe"),
        (r#"{"kind":{"Fields":[1,"x"]}}"#, "kind.Fields"),
        (r#"{"kind":{"Newtype":[1,"x"]}}"#, "kind.Newtype"),
        (r#"{"by_name":{"k":{"a":1,"b":"x"},"m":[1,"x"]}}"#, "by_name.m"),
        (r#"{"tagged":[["One",1]]}"#, "tagged[0]"),
        (r#"{"pair":[1,[1,"x"]]}"#, "pair[1]"),
        (r#"{"wrapped":[1,"x"]}"#, "wrapped"),
    ] {
        let want = format!("{at}: expected a JSON object, found an array");
        assert_eq!(refusal::<Outer>(body), want, "{body}");
        // As the three passes said.
        assert_eq!(
            outcome(three_passes::<Outer>(body.as_bytes())),
            Err(want),
            "{body}"
        );
    }
}

#[test]
fn arrays_where_the_type_has_a_sequence_are_read() {
    let body = r#"{"items":[{"a":1,"b":"x"}],"kind":{"Tuple":[1,2]},"pair":[3,{"a":4,"b":"z"}],
        "tagged":[{"t":"One","a":5}],"wrapped":{"a":6,"b":"w"},"by_name":{"k":{"a":7,"b":"\u00e9\n"}}}"#;
    let read: Outer = parse_object(body.as_bytes()).unwrap();
    assert_eq!(read.kind, Some(Kind::Tuple(1, 2)));
    assert_eq!(read.tagged, vec![Tagged::One { a: 5 }]);
    assert_eq!(read.by_name["k"].b, "é\n");
    assert_eq!(
        outcome(parse_object::<Outer>(body.as_bytes())),
        outcome(three_passes::<Outer>(body.as_bytes()))
    );
    let read: Outer = parse_object(br#"{"kind":"Unit"}"#).unwrap();
    assert_eq!(read.kind, Some(Kind::Unit));
}

#[test]
fn the_request_types_refuse_an_array_for_an_object_as_before() {
    // Read positionally, this would be an admin named arr2.
    assert_eq!(
        refusal::<CreateUserRequest>(r#"["arr2","admin"]"#),
        "the request body must be a JSON object"
    );
    let grant = r#"{"name":"acme","targets":[{"target":"web01","port":22},["web01",443]],"ttl_seconds":60}"#;
    assert_eq!(
        refusal::<CreateGrantRequest>(grant),
        "targets[1]: expected a JSON object, found an array"
    );
    // A heartbeat's roles, a guest, and a session event (internally tagged:
    // serde would take its tag from the sequence's first element).
    let t = "2026-12-05T10:00:00Z";
    for (field, value, at) in [
        ("roles", json!([true, null]), "roles"),
        ("guests", json!([["vm-1", "running", null]]), "guests[0]"),
        (
            "session_events",
            json!([["start", "s1", t, "user:a", "web01", 22, "net", null]]),
            "session_events[0]",
        ),
        (
            "session_bytes",
            json!([{"session":"s","bytes_up":1,"bytes_down":2}, ["s", 1, 2]]),
            "session_bytes[1]",
        ),
    ] {
        let body = json!({"node": "n1", "vtep": "10.0.0.1", field: value}).to_string();
        let want = format!("{at}: expected a JSON object, found an array");
        assert_eq!(refusal::<Heartbeat>(&body), want, "{body}");
        assert_eq!(
            outcome(three_passes::<Heartbeat>(body.as_bytes())),
            Err(want),
            "{body}"
        );
    }
}

#[test]
fn other_refusals_read_as_axum_wrote_them() {
    let cases = [
        "{",
        r#"{"no_such_field": 1}"#,
        r#"{"name":"alice","role":"user"} x"#,
        r#"{"name":"alice","role":"user"}{}"#,
        r#"{"name":"alice","role":"root"}"#,
        r#"{"name":"alice"}"#,
        r#"{"name":"Alice","role":"user"}"#,
        r#"{"name":7,"role":"user"}"#,
        r#"{"name":"alice","role":"user","role":"user"}"#,
        r#"{"name":"alice","role":["user"]}"#,
        "\"web01\"",
        "[]",
        "",
        "  ",
        "{\"name\":\"al\u{0}ice\"}",
    ];
    for body in cases {
        let new = outcome(parse_object::<CreateUserRequest>(body.as_bytes()));
        assert!(new.is_err(), "{body}");
        assert_eq!(
            new,
            outcome(three_passes::<CreateUserRequest>(body.as_bytes())),
            "{body}"
        );
    }
    // The messages name the field, as axum's did.
    assert!(
        refusal::<CreateUserRequest>(r#"{"name":"alice","role":"root"}"#).starts_with(
            "Failed to deserialize the JSON body into the target type: role: unknown variant `root`"
        )
    );
    assert!(
        refusal::<CreateUserRequest>(r#"{"name":"alice","role":"user"} x"#)
            .starts_with("Failed to parse the request body as JSON: trailing characters")
    );
}

fn name() -> impl Strategy<Value = String> {
    "[a-z0-9][a-z0-9-]{0,14}"
}

/// Any text, escapes and non-ASCII included (a string serde_json cannot
/// borrow from the body).
fn text() -> impl Strategy<Value = String> {
    "\\PC{0,12}"
}

fn instant() -> impl Strategy<Value = OffsetDateTime> {
    (0i64..4_000_000_000).prop_map(|s| OffsetDateTime::from_unix_timestamp(s).unwrap())
}

fn guest() -> impl Strategy<Value = GuestStatus> {
    (
        name(),
        0usize..4,
        proptest::option::of(text()),
        proptest::option::of(any::<bool>()),
    )
        .prop_map(|(vm_id, state, reason, kvm)| GuestStatus {
            vm_id,
            state: [
                VmState::Pending,
                VmState::Running,
                VmState::Failed,
                VmState::Migrating,
            ][state],
            reason,
            accelerator: kvm.map(|k| if k { Accelerator::Kvm } else { Accelerator::Tcg }),
        })
}

fn health() -> impl Strategy<Value = HealthReport> {
    (
        (name(), name(), 0usize..3, instant()),
        (
            proptest::option::of(instant()),
            proptest::option::of(text()),
            any::<u32>(),
            any::<u32>(),
        ),
    )
        .prop_map(
            |((lb, vm_id, h, probed_at), (changed_at, reason, successes, failures))| HealthReport {
                lb,
                vm_id,
                health: [Health::Unknown, Health::Healthy, Health::Unhealthy][h],
                probed_at,
                changed_at,
                reason,
                successes,
                failures,
            },
        )
}

fn session_event() -> impl Strategy<Value = SessionEvent> {
    (
        (name(), instant(), text(), name(), any::<u16>(), name()),
        (
            any::<bool>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            text(),
            proptest::option::of(text()),
        ),
    )
        .prop_map(
            |(
                (session, at, principal, vm, port, network),
                (start, bytes_up, bytes_down, duration_ms, reason, credential),
            )| {
                if start {
                    SessionEvent::Start {
                        session,
                        at,
                        principal,
                        vm,
                        port,
                        network,
                        credential,
                    }
                } else {
                    SessionEvent::End {
                        session,
                        at,
                        principal,
                        vm,
                        port,
                        network,
                        bytes_up,
                        bytes_down,
                        duration_ms,
                        reason,
                        credential,
                    }
                }
            },
        )
}

prop_compose! {
    fn heartbeat()(
        (node, vtep, applied_version, version, netns, session_epoch) in
            (name(), "[0-9.]{7,15}", proptest::option::of(any::<u64>()), text(),
             proptest::option::of(name()), proptest::option::of(name())),
        roles in proptest::option::of((any::<bool>(), proptest::option::of(text()), proptest::option::of(text()))),
        guests in proptest::collection::vec(guest(), 0..120),
        health in proptest::collection::vec(health(), 0..60),
        sessions in proptest::collection::btree_map(name(), any::<u32>(), 0..5),
        ready_overlays in proptest::collection::vec(name(), 0..8),
        migrations in proptest::collection::vec((name(), any::<bool>(), proptest::option::of(text())), 0..3),
        incoming in proptest::collection::vec((name(), name(), any::<u16>()), 0..3),
        session_events in proptest::collection::vec(session_event(), 0..6),
        session_bytes in proptest::collection::vec((name(), any::<u64>(), any::<u64>()), 0..6),
        flags in any::<[bool; 5]>(),
    ) -> Heartbeat {
        Heartbeat {
            node,
            roles: roles.map(|(hypervisor, gateway, relay)| NodeRoles { hypervisor, gateway, relay }),
            vtep,
            applied_version,
            guests,
            sessions,
            health,
            health_changes_only: flags[0],
            netns,
            ready_overlays,
            migrations: migrations
                .into_iter()
                .map(|(vm_id, moved, reason)| MigrationReport {
                    vm_id,
                    outcome: if moved { MigrationOutcome::Moved } else { MigrationOutcome::Failed },
                    reason,
                })
                .collect(),
            incoming: incoming
                .into_iter()
                .map(|(vm_id, migration, port)| IncomingReady { vm_id, migration, port })
                .collect(),
            session_epoch,
            session_events,
            session_bytes: session_bytes
                .into_iter()
                .map(|(session, bytes_up, bytes_down)| SessionBytes { session, bytes_up, bytes_down })
                .collect(),
            version,
            accepts_unchanged: flags[1],
            accepts_delta: flags[2],
            accepts_guest_changes: flags[3],
            reads_one_session_revocations: flags[4],
        }
    }
}

/// Every object inside `v` (not `v` itself), with its path as the refusal
/// names it.
fn objects_within(v: &Value, at: &str, out: &mut Vec<String>) {
    let inner = |k: &str| {
        if at.is_empty() {
            k.to_string()
        } else {
            format!("{at}.{k}")
        }
    };
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                if v.is_object() {
                    out.push(inner(k));
                }
                objects_within(v, &inner(k), out);
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                let here = format!("{at}[{i}]");
                if v.is_object() {
                    out.push(here.clone());
                }
                objects_within(v, &here, out);
            }
        }
        _ => {}
    }
}

/// `v` with the object at `path` replaced by the array of its values.
fn object_to_array(v: &mut Value, path: &str) {
    let pointer = format!("/{}", path.replace("[", ".").replace("]", "").replace('.', "/"));
    let place = v.pointer_mut(&pointer).unwrap();
    let values = place.as_object().unwrap().values().cloned().collect();
    *place = Value::Array(values);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_valid_heartbeat_reads_as_the_three_passes_read_it(hb in heartbeat(), pretty in any::<bool>()) {
        let body = if pretty { serde_json::to_vec_pretty(&hb) } else { serde_json::to_vec(&hb) }.unwrap();
        let new = outcome(parse_object::<Heartbeat>(&body));
        prop_assert!(new.is_ok(), "{:?}", new);
        prop_assert_eq!(&new, &outcome(three_passes::<Heartbeat>(&body)));
        prop_assert_eq!(new.unwrap(), serde_json::to_value(&hb).unwrap());
    }

    #[test]
    fn a_heartbeat_with_an_object_sent_as_an_array_is_refused_where_it_was(
        hb in heartbeat(),
        pick in any::<proptest::sample::Index>(),
    ) {
        let mut v = serde_json::to_value(&hb).unwrap();
        let mut places = Vec::new();
        objects_within(&v, "", &mut places);
        prop_assume!(!places.is_empty());
        let at = pick.get(&places).clone();
        object_to_array(&mut v, &at);
        let body = v.to_string();
        let new = outcome(parse_object::<Heartbeat>(body.as_bytes()));
        let old = outcome(three_passes::<Heartbeat>(body.as_bytes()));
        prop_assert!(new.is_err() && old.is_err(), "{:?} {:?}", new, old);
        // A struct's place: this refusal (the three passes said the same
        // when the values were in the fields' order, or a positional
        // error); a map's (`sessions`): serde_json's refusal, as before.
        let mine = format!("{at}: expected a JSON object, found an array");
        if at == "sessions" {
            prop_assert_eq!(&new, &old);
        } else {
            prop_assert_eq!(new, Err(mine));
        }
    }

    #[test]
    fn a_damaged_heartbeat_is_refused_as_the_three_passes_refused_it(
        hb in heartbeat(),
        cut in any::<proptest::sample::Index>(),
        byte in any::<u8>(),
        how in 0usize..3,
    ) {
        let mut body = serde_json::to_vec(&hb).unwrap();
        let at = cut.index(body.len());
        match how {
            0 => body.truncate(at),
            1 => body[at] = byte,
            _ => body.insert(at, byte),
        }
        let new = outcome(parse_object::<Heartbeat>(&body));
        let old = outcome(three_passes::<Heartbeat>(&body));
        // The same, unless the damage made an array of an object (a `[`
        // for a `{`): refused at once now, where serde_json read on
        // positionally before and found the syntax broken further on.
        let array_for_object = new
            .as_ref()
            .is_err_and(|m| m.ends_with(": expected a JSON object, found an array"));
        if !(array_for_object && old.is_err()) {
            prop_assert_eq!(new, old, "{}", String::from_utf8_lossy(&body));
        }
    }
}

/// Not a test: how long each reading takes on a heartbeat as a node with
/// 100 guests and 100 health verdicts sends it (the 1,000-node scale row's
/// whole set). `cargo test --release -p otherix-server --lib heartbeat_parse_cost -- --ignored --nocapture`
#[test]
#[ignore]
fn heartbeat_parse_cost() {
    use std::time::Instant;
    let at = OffsetDateTime::from_unix_timestamp(1_796_000_000).unwrap();
    let hb = Heartbeat {
        node: "hv-0421".into(),
        roles: None,
        vtep: "10.50.1.167".into(),
        applied_version: Some(18_334),
        guests: (0..100)
            .map(|i| GuestStatus {
                vm_id: format!("vm-0421-{i:04}-7f3a9c"),
                state: VmState::Running,
                reason: None,
                accelerator: None,
            })
            .collect(),
        sessions: BTreeMap::new(),
        health: (0..100)
            .map(|i| HealthReport {
                lb: format!("lb-{:05}", i * 7),
                vm_id: format!("vm-0421-{i:04}-7f3a9c"),
                health: Health::Healthy,
                probed_at: at,
                changed_at: Some(at),
                reason: None,
                successes: 1_000 + i,
                failures: 0,
            })
            .collect(),
        health_changes_only: false,
        netns: None,
        ready_overlays: (0..10).map(|i| format!("net-{i:03}")).collect(),
        migrations: Vec::new(),
        incoming: Vec::new(),
        session_epoch: Some("b1946ac92492d234".into()),
        session_events: Vec::new(),
        session_bytes: Vec::new(),
        version: "otherix-bench/0.1.0".into(),
        accepts_unchanged: true,
        accepts_delta: true,
        accepts_guest_changes: true,
        reads_one_session_revocations: true,
    };
    let body = bytes::Bytes::from(serde_json::to_vec(&hb).unwrap());
    let rounds = 2_000u32;
    for round in 0..3 {
        let t = Instant::now();
        for _ in 0..rounds {
            std::hint::black_box(three_passes::<Heartbeat>(&body).unwrap());
        }
        let old = t.elapsed() / rounds;
        let t = Instant::now();
        for _ in 0..rounds {
            std::hint::black_box(parse_object::<Heartbeat>(&body).unwrap());
        }
        let new = t.elapsed() / rounds;
        println!(
            "round {round}: {} bytes: three passes {old:?}, one pass {new:?} ({:.2}x)",
            body.len(),
            old.as_secs_f64() / new.as_secs_f64()
        );
    }
}
