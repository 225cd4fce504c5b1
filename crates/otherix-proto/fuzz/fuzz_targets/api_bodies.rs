//! Fuzzes every JSON body the control plane accepts from agents and
//! clients, deserialized exactly as its `ApiJson` extractor does (axum's
//! `Json`: `serde_path_to_error` over `serde_json`, then the end of input),
//! then checked by the pure validators from otherix-core that its handler
//! runs on that body, in the handler's order. The first byte picks the
//! body. Checks that need the store (does the VM exist, is the join token
//! valid) and the handlers' private helpers are not reached.
#![no_main]

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use otherix_proto::agent::{
    CertificateRequest, CreateJoinTokenRequest, EnrollRequest, Heartbeat, UpdateNodeRequest,
    MAX_SESSION_EVENTS,
};
use otherix_proto::{AddNetworkNodeRequest, AllowRequest, BrokerRequest, CreateGrantRequest, CreateLbRequest, CreateNetworkRequest, CreateUserRequest, CreateVmRequest, LabelVmRequest, MigrateVmRequest, UpdateLbRequest};
use otherix_core::ipam::Subnet;
use otherix_core::labels::{validate_label_key, validate_label_value};
use otherix_core::names::validate_name;
use otherix_core::node::{
    check_claims, effective_vtep, parse_endpoint, parse_relay, parse_vtep, validate_node_name, Roles,
};
use otherix_core::selector::Selector;
use serde::de::DeserializeOwned;

/// The CP's `ApiJson`: axum's `Json::from_bytes`.
fn body<T: DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize(&mut deserializer) {
        Ok(value) => match deserializer.end() {
            Ok(()) => Some(value),
            Err(e) => {
                let _ = e.to_string();
                None
            }
        },
        // The refusal's message is built from the error and its path.
        Err(e) => {
            let _ = (e.path().to_string(), e.inner().classify(), e.to_string());
            None
        }
    }
}

/// `lb/NAME` or a VM name, as the broker and grants check a target.
fn target_name(target: &str) -> bool {
    validate_name(target.strip_prefix("lb/").unwrap_or(target)).is_ok()
}

fn labels_ok<'a>(labels: impl IntoIterator<Item = (&'a String, &'a String)>) -> bool {
    labels
        .into_iter()
        .all(|(k, v)| validate_label_key(k).is_ok() && validate_label_value(v).is_ok())
}

/// Node roles addresses as the join-token and node-update handlers check them.
fn grant(gateway: Option<&str>, relay: Option<&str>, vtep: Option<&str>) {
    if let Some(g) = gateway {
        if let Ok(addr) = parse_endpoint("gateway endpoint", g) {
            assert!(addr.port() != 0 && !addr.ip().is_unspecified() && !addr.ip().is_multicast());
        }
    }
    if let Some(r) = relay {
        if let Ok(Some(stored)) = parse_relay("relay endpoint", r) {
            // What is stored reads back the same.
            assert_eq!(parse_relay("relay endpoint", &stored), Ok(Some(stored.clone())));
        }
    }
    if let Some(v) = vtep {
        if let Ok(ip) = parse_vtep("vtep", v) {
            assert!(!ip.is_unspecified() && !ip.is_multicast() && !ip.is_broadcast());
        }
    }
}

fn heartbeat(hb: Heartbeat) {
    // `check_assertions`: the VTEP in force, from a grant or the source
    // address, then the pinned roles against a grant.
    let from = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7));
    for granted in [None, Some(Ipv4Addr::new(192, 0, 2, 7))] {
        if let Ok(vtep) = effective_vtep(&hb.node, &hb.vtep, granted, from) {
            assert_eq!(Some(vtep), hb.vtep.parse().ok(), "the VTEP in force is the reported one");
        }
    }
    if let Some(claimed) = &hb.roles {
        let addr = |s: &Option<String>| s.as_deref().and_then(|a| a.parse::<SocketAddr>().ok());
        let claimed = Roles {
            hypervisor: claimed.hypervisor,
            gateway: addr(&claimed.gateway),
            relay: addr(&claimed.relay),
        };
        let granted = Roles {
            hypervisor: true,
            gateway: "192.0.2.7:8443".parse().ok(),
            relay: "192.0.2.7:7444".parse().ok(),
        };
        if let Err(m) = check_claims(&hb.node, &granted, &claimed) {
            let _ = (m.code(), m.to_string());
        }
        assert!(check_claims(&hb.node, &claimed, &claimed).is_ok());
    }
    if hb.session_events.len() > MAX_SESSION_EVENTS {
        return;
    }
    for event in &hb.session_events {
        let _ = event.session();
    }
    for h in &hb.health {
        let _: String = h.reason.as_deref().unwrap_or_default().chars().take(200).collect();
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, json)) = data.split_first() else {
        return;
    };
    match which % 16 {
        0 => {
            if let Some(hb) = body::<Heartbeat>(json) {
                heartbeat(hb);
            }
        }
        1 => {
            if let Some(req) = body::<EnrollRequest>(json) {
                let _ = validate_node_name(&req.node).map_err(|e| e.to_string());
                let _ = req.join_token.trim();
            }
        }
        2 => {
            if let Some(req) = body::<BrokerRequest>(json) {
                if target_name(&req.target) {
                    let _ = u16::try_from(req.port).ok().filter(|p| *p != 0);
                    for name in &req.exclude {
                        let _ = validate_name(name);
                    }
                }
            }
        }
        3 => {
            if let Some(req) = body::<CreateGrantRequest>(json) {
                let _ = validate_name(&req.name).map_err(|e| e.to_string());
                for t in &req.targets {
                    let _ = (t.port != 0, target_name(&t.target), t.to_string());
                }
            }
        }
        4 => {
            if let Some(req) = body::<CreateJoinTokenRequest>(json) {
                if validate_node_name(&req.node).is_ok() {
                    grant(req.gateway.as_deref(), req.relay.as_deref(), req.vtep.as_deref());
                }
            }
        }
        5 => {
            if let Some(req) = body::<UpdateNodeRequest>(json) {
                let gateway = req.gateway.as_deref().filter(|g| *g != "none");
                let vtep = req.vtep.as_deref().filter(|v| *v != "auto");
                grant(gateway, req.relay.as_deref(), vtep);
            }
        }
        6 => {
            if let Some(req) = body::<CertificateRequest>(json) {
                let _ = (req.purpose.as_str(), req.csr_pem.len());
            }
        }
        7 => {
            if let Some(req) = body::<CreateUserRequest>(json) {
                let _ = (validate_name(&req.name), req.role.as_str());
            }
        }
        8 => {
            if let Some(req) = body::<AllowRequest>(json) {
                if let Ok(selector) = req.selector.parse::<Selector>() {
                    assert_eq!(selector.to_string().parse::<Selector>().as_ref(), Ok(&selector));
                    let _: BTreeSet<u16> = req.ports.iter().copied().collect();
                }
            }
        }
        9 => {
            if let Some(req) = body::<CreateNetworkRequest>(json) {
                if validate_name(&req.name).is_ok() {
                    if let Ok(subnet) = req.subnet.parse::<Subnet>() {
                        assert_eq!(subnet.to_string().parse::<Subnet>().as_ref(), Ok(&subnet));
                        let _ = (subnet.node_address(), subnet.capacity(), subnet.lease_range());
                    }
                    for node in req.node.iter().chain(&req.nodes) {
                        let _ = validate_name(node);
                    }
                }
            }
        }
        10 => {
            if let Some(req) = body::<AddNetworkNodeRequest>(json) {
                let _ = validate_name(&req.node);
            }
        }
        11 => {
            if let Some(req) = body::<CreateVmRequest>(json) {
                if validate_name(&req.name).is_ok() && labels_ok(&req.labels) {
                    if let Some(node) = &req.node {
                        let _ = validate_name(node);
                    }
                    let _ = req.exec.as_deref().map(|e| e.trim().is_empty());
                }
            }
        }
        12 => {
            if let Some(req) = body::<LabelVmRequest>(json) {
                if labels_ok(&req.set) {
                    for key in &req.remove {
                        let _ = (validate_label_key(key), req.set.contains_key(key));
                    }
                }
            }
        }
        13 => {
            if let Some(req) = body::<MigrateVmRequest>(json) {
                let _ = validate_name(&req.to);
            }
        }
        14 => {
            if let Some(req) = body::<CreateLbRequest>(json) {
                if validate_name(&req.name).is_ok() {
                    let _ = req.selector.parse::<Selector>();
                }
            }
        }
        _ => {
            if let Some(req) = body::<UpdateLbRequest>(json) {
                if let Some(s) = &req.selector {
                    let _ = s.parse::<Selector>();
                }
            }
        }
    }
});
