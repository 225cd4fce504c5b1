//! `otherix keys list|rotate` against a real control plane, with a fake
//! gateway node heartbeating: a rotation is published at once, signs within
//! seconds, and the previous key is published with the expiry gateways
//! refuse its credentials after. The end-to-end version (real gateways,
//! sessions open across a rotation) is `keys_e2e.rs`.

mod common;

use common::fake_node::{empty_heartbeat, enroll_as, rt};
use common::Cp;
use otherix_client::Client;
use otherix_proto::agent::{Heartbeat, NodeRoles, SessionPublicKey};
use serde_json::Value;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// The keys a gateway is given in its next heartbeat answer.
fn gateway_keys(gw: &Client) -> Vec<SessionPublicKey> {
    rt().block_on(gw.heartbeat(&Heartbeat {
        node: "gw".into(),
        roles: Some(NodeRoles {
            hypervisor: false,
            gateway: Some("10.214.1.13:8443".into()),
            relay: None,
        }),
        vtep: "10.214.1.13".into(),
        ..empty_heartbeat()
    }))
    .unwrap()
    .session_keys
}

fn time_of(v: &Value) -> OffsetDateTime {
    OffsetDateTime::parse(v.as_str().unwrap_or_else(|| panic!("not a time: {v}")), &Rfc3339).unwrap()
}

fn kids(list: &Value) -> Vec<(String, String)> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|k| {
            (
                k["kid"].as_str().unwrap().into(),
                k["state"].as_str().unwrap().into(),
            )
        })
        .collect()
}

#[test]
fn a_rotation_is_published_at_once_signs_when_it_returns_and_the_old_key_expires_a_credential_life_later() {
    let cp = Cp::start();
    let admin = cp.admin();
    let gw = enroll_as(&cp, "gw", "10.214.1.13", true);
    let before = admin.json(&["keys", "list"]);
    let [(old, state)] = kids(&before).try_into().expect("one key in a new cluster");
    assert_eq!(state, "current");
    assert!(
        before[0]["expires_at"].is_null(),
        "the signing key has no expiry yet: {before}"
    );
    let published = gateway_keys(&gw);
    assert_eq!(published.len(), 1);
    assert_eq!(
        (published[0].kid.as_str(), published[0].not_after),
        (old.as_str(), None)
    );

    let asked = OffsetDateTime::now_utc();
    let rotated = admin.json(&["keys", "rotate"]);
    let new = rotated["key"]["kid"].as_str().unwrap().to_string();
    assert_ne!(new, old);
    assert_eq!(
        rotated["key"]["state"], "current",
        "it signs once the command returns: {rotated}"
    );
    let signs_from = time_of(&rotated["key"]["signs_from"]);
    assert!(OffsetDateTime::now_utc() >= signs_from);
    assert!(
        signs_from - asked <= time::Duration::seconds(6),
        "within seconds: {rotated}"
    );
    let retiring = &rotated["retiring"][0];
    assert_eq!(retiring["kid"], old.as_str(), "{rotated}");
    let expires = time_of(&retiring["expires_at"]);
    // Stopped signing at the new key's start; credentials live 5 min by
    // default, and gateways allow 30 s of clock skew.
    assert_eq!(expires, signs_from + time::Duration::seconds(330));

    // Gateways get both, the old one with its expiry.
    let published = gateway_keys(&gw);
    assert_eq!(published.len(), 2, "{published:?}");
    assert_eq!(
        (published[0].kid.as_str(), published[0].not_after),
        (new.as_str(), None)
    );
    assert_eq!(
        (published[1].kid.as_str(), published[1].not_after),
        (old.as_str(), Some(expires))
    );
    let after = admin.json(&["keys", "list"]);
    assert_eq!(
        kids(&after),
        [(new.clone(), "current".into()), (old.clone(), "previous".into())]
    );
    assert_eq!(time_of(&after[1]["expires_at"]), expires);
    let table = admin.ok(&["keys", "list"]);
    assert!(table.starts_with("KID"), "{table}");
    assert!(table.contains(&new) && table.contains("previous"), "{table}");

    // Audited: who rotated, to which key, when the old one retires.
    let trail = admin.json(&["audit", "--since", "1h"]);
    let record = trail
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["action"] == "key_rotate")
        .unwrap_or_else(|| panic!("no key_rotate record: {trail}"));
    assert_eq!(record["principal"], "user:admin");
    assert_eq!(record["target"], new.as_str());
    assert!(
        record["reason"]
            .as_str()
            .unwrap()
            .contains(&format!("{old} retires at")),
        "{record}"
    );
}

#[test]
fn only_an_admin_rotates_and_a_refused_rotation_changes_nothing() {
    let cp = Cp::start();
    let admin = cp.admin();
    admin.ok(&["user", "create", "uma", "--role", "user"]);
    admin.ok(&["user", "create", "vera", "--role", "viewer"]);
    let uma = admin.with_token(admin.ok(&["user", "token", "create", "uma"]).trim());
    let vera = admin.with_token(admin.ok(&["user", "token", "create", "vera"]).trim());
    let before = kids(&admin.json(&["keys", "list"]));
    let err = vera.fails(&["keys", "rotate"]);
    assert!(err.contains("role viewer may not rotate session keys"), "{err}");
    let err = uma.fails(&["keys", "rotate"]);
    assert!(err.contains("role user may not rotate session keys"), "{err}");
    assert_eq!(kids(&vera.json(&["keys", "list"])), before, "nothing was made");
    let err = uma.fails(&["keys", "list"]);
    assert!(err.contains("role user may not list session keys"), "{err}");
    let trail = admin.json(&["audit", "--since", "1h"]);
    assert!(
        !trail
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["action"] == "key_rotate"),
        "{trail}"
    );
}

#[test]
fn the_openapi_document_lists_the_key_operations() {
    let cp = Cp::start();
    let (status, body) = common::curl(&cp, &[&format!("{}/v1/openapi.json", cp.url)]);
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert!(doc["paths"]["/v1/keys"]["get"].is_object(), "GET /v1/keys");
    assert!(
        doc["paths"]["/v1/keys/rotate"]["post"].is_object(),
        "POST /v1/keys/rotate"
    );
    for schema in ["SessionKeyInfo", "KeyRotation", "KeyState"] {
        assert!(
            doc["components"]["schemas"].get(schema).is_some(),
            "no {schema} schema"
        );
    }
    let key = &doc["components"]["schemas"]["SessionKeyInfo"]["properties"];
    for field in ["kid", "created_at", "signs_from", "state", "expires_at"] {
        assert!(key.get(field).is_some(), "SessionKeyInfo lacks {field}: {key}");
    }
}
