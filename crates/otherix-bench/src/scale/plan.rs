//! What a scale row builds, as pure functions of the row: the row spec
//! (`NODESxVMS[xLBS]`), node names and VTEPs, networks and their subnets,
//! VM names, networks and labels, LB selectors. Nothing here talks to the
//! control plane, so every name and address is a unit test.

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;

use anyhow::{bail, Context};

/// One row of the scale table: how many nodes, VMs and LBs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Row {
    pub nodes: usize,
    pub vms: usize,
    pub lbs: usize,
}

/// Largest row accepted (each bound well past the stretch row).
const MAX_NODES: usize = 5_000;
const MAX_VMS: usize = 200_000;
const MAX_LBS: usize = 20_000;

impl Row {
    /// `NODESxVMS` or `NODESxVMSxLBS`; `_` may group digits (`100x10_000`).
    pub fn parse(s: &str) -> anyhow::Result<Row> {
        let parts: Vec<&str> = s.trim().split('x').collect();
        if !(2..=3).contains(&parts.len()) {
            bail!("scale row {s:?}: expected NODESxVMS or NODESxVMSxLBS, e.g. 100x10000x1000");
        }
        let count = |what: &str, text: &str, max: usize| -> anyhow::Result<usize> {
            let n: usize = text
                .replace('_', "")
                .parse()
                .with_context(|| format!("scale row {s:?}: {what} {text:?} is not a number"))?;
            if n > max {
                bail!("scale row {s:?}: at most {max} {what}");
            }
            Ok(n)
        };
        let row = Row {
            nodes: count("nodes", parts[0], MAX_NODES)?,
            vms: count("VMs", parts[1], MAX_VMS)?,
            lbs: parts.get(2).map_or(Ok(0), |t| count("LBs", t, MAX_LBS))?,
        };
        if row.nodes == 0 {
            bail!("scale row {s:?}: needs at least one node");
        }
        Ok(row)
    }

    /// A comma-separated list of rows.
    pub fn parse_list(s: &str) -> anyhow::Result<Vec<Row>> {
        let rows: Vec<Row> = s
            .split(',')
            .filter(|r| !r.trim().is_empty())
            .map(Row::parse)
            .collect::<anyhow::Result<_>>()?;
        if rows.is_empty() {
            bail!("no scale rows in {s:?}");
        }
        Ok(rows)
    }

    /// The rows issue #14 asks for (the stretch row only when named).
    pub fn defaults() -> Vec<Row> {
        Row::parse_list(DEFAULT_ROWS).unwrap_or_default()
    }
}

/// `--scale-rows` when not given.
pub const DEFAULT_ROWS: &str = "10x200,100x2000,100x10000,100x10000x1000";

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} / {} / {}",
            thousands(self.nodes as u64),
            thousands(self.vms as u64),
            thousands(self.lbs as u64)
        )
    }
}

/// `12345` → `12,345`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// How a row is laid out. Nodes `0..gateways` are gateways (no hypervisor
/// role), the rest hypervisors; VMs go round-robin over the networks, and
/// VM `i` carries `app=a{i mod LBs}`, so LB `j` selects every VM whose
/// index is `j` modulo the LB count.
#[derive(Debug, Clone)]
pub struct Plan {
    pub row: Row,
    pub gateways: usize,
    pub vms_per_network: usize,
    /// VMs created while every node heartbeats (the VM create rate); the
    /// others are created on named hypervisors before any node heartbeats.
    pub live_vms: usize,
}

/// One simulated node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub name: String,
    /// Granted in its join token: its connections come from 127.0.0.1.
    pub vtep: Ipv4Addr,
    pub gateway: bool,
}

impl NodeSpec {
    /// The gateway's advertised address (nothing listens there: the
    /// broker only names it).
    pub fn gateway_endpoint(&self) -> Option<String> {
        self.gateway.then(|| format!("{}:8443", self.vtep))
    }
}

/// Most networks: each takes a /16 of 10.64.0.0–10.213.0.0, below the
/// testbed's 10.213.0.0/16.
const MAX_NETWORKS: usize = 149;
/// Addresses a network's VMs may take: a /16, less room for the members' leases.
const MAX_VMS_PER_NETWORK: usize = 60_000;

impl Plan {
    /// The live VMs when not given: 2 % of the row, 20 to 200 (at
    /// 10,000 VMs the current code creates about one a second).
    pub fn default_live_vms(vms: usize) -> usize {
        (vms / 50).clamp(20, 200).min(vms)
    }

    pub fn new(
        row: Row,
        gateways: usize,
        vms_per_network: usize,
        live_vms: Option<usize>,
    ) -> anyhow::Result<Plan> {
        if vms_per_network == 0 || vms_per_network > MAX_VMS_PER_NETWORK {
            bail!("VMs per network must be between 1 and {MAX_VMS_PER_NETWORK}");
        }
        if gateways == 0 {
            bail!("the broker needs a gateway: at least one");
        }
        if row.vms > 0 && row.nodes <= gateways {
            bail!(
                "row {row}: {} nodes leave no hypervisor beside {gateways} gateway(s)",
                row.nodes
            );
        }
        let plan = Plan {
            row,
            gateways,
            vms_per_network,
            live_vms: live_vms.unwrap_or(Plan::default_live_vms(row.vms)).min(row.vms),
        };
        if plan.networks() > MAX_NETWORKS {
            bail!(
                "row {row}: {} networks are too many (at most {MAX_NETWORKS}); raise --scale-vms-per-network",
                plan.networks()
            );
        }
        Ok(plan)
    }

    pub fn networks(&self) -> usize {
        self.row.vms.div_ceil(self.vms_per_network).max(1)
    }

    pub fn network_name(i: usize) -> String {
        format!("scale-net-{i:03}")
    }

    /// `10.(64+i).0.0/16`.
    pub fn subnet(i: usize) -> String {
        format!("10.{}.0.0/16", 64 + i)
    }

    pub fn node(&self, k: usize) -> NodeSpec {
        // 10.50.0.1, 10.50.0.2, ... 10.50.0.250, 10.50.1.1, ...
        let vtep = Ipv4Addr::new(10, 50, (k / 250) as u8, (k % 250 + 1) as u8);
        if k < self.gateways {
            NodeSpec {
                name: format!("gw-{k:02}"),
                vtep,
                gateway: true,
            }
        } else {
            NodeSpec {
                name: format!("hv-{:04}", k - self.gateways),
                vtep,
                gateway: false,
            }
        }
    }

    pub fn nodes(&self) -> Vec<NodeSpec> {
        (0..self.row.nodes).map(|k| self.node(k)).collect()
    }

    pub fn vm_name(i: usize) -> String {
        format!("vm-{i:06}")
    }

    pub fn vm_network(&self, i: usize) -> String {
        Plan::network_name(i % self.networks())
    }

    /// `app=a{i mod LBs}` (mod 100 without LBs) and `tier=web`.
    pub fn vm_labels(&self, i: usize) -> BTreeMap<String, String> {
        let group = if self.row.lbs == 0 {
            i % 100
        } else {
            i % self.row.lbs
        };
        BTreeMap::from([
            ("app".to_string(), format!("a{group}")),
            ("tier".to_string(), "web".to_string()),
        ])
    }

    pub fn lb_name(j: usize) -> String {
        format!("lb-{j:05}")
    }

    /// Selects the VMs labelled `app=a{j}` (and `tier=web`, which all are:
    /// two requirements per selector, as a real one might have).
    pub fn lb_selector(j: usize) -> String {
        format!("app=a{j},tier=web")
    }

    /// VMs created before any node heartbeats: `0..bulk_vms()`.
    pub fn bulk_vms(&self) -> usize {
        self.row.vms - self.live_vms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_nodes_by_vms_by_lbs() {
        assert_eq!(
            Row::parse("100x10_000x1000").unwrap(),
            Row {
                nodes: 100,
                vms: 10_000,
                lbs: 1_000
            }
        );
        assert_eq!(Row::parse("10x200").unwrap().lbs, 0);
        assert_eq!(Row::defaults().len(), 4);
        assert_eq!(Row::defaults()[3].lbs, 1_000);
        assert_eq!(
            Row::parse_list("10x200, 1000x100000x10000").unwrap()[1],
            Row {
                nodes: 1_000,
                vms: 100_000,
                lbs: 10_000
            }
        );
        for bad in [
            "",
            "10",
            "10x",
            "x200",
            "10x200x3x4",
            "0x10",
            "ten x 200",
            "9000x10",
        ] {
            assert!(Row::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Row::parse_list(",").is_err());
    }

    #[test]
    fn rows_print_with_thousands_separators() {
        assert_eq!(
            Row::parse("100x10000x1000").unwrap().to_string(),
            "100 / 10,000 / 1,000"
        );
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn nodes_are_gateways_then_hypervisors_each_with_its_own_vtep() {
        let plan = Plan::new(Row::parse("1000x10").unwrap(), 1, 1000, None).unwrap();
        let nodes = plan.nodes();
        assert_eq!(nodes[0].name, "gw-00");
        assert_eq!(nodes[0].gateway_endpoint().as_deref(), Some("10.50.0.1:8443"));
        assert_eq!(
            (nodes[1].name.as_str(), nodes[1].vtep),
            ("hv-0000", Ipv4Addr::new(10, 50, 0, 2))
        );
        assert_eq!(nodes[250].vtep, Ipv4Addr::new(10, 50, 1, 1));
        assert!(nodes[1].gateway_endpoint().is_none());
        let mut vteps: Vec<_> = nodes.iter().map(|n| n.vtep).collect();
        vteps.sort();
        vteps.dedup();
        assert_eq!(vteps.len(), 1000);
    }

    #[test]
    fn vms_go_round_robin_over_networks_and_each_lb_selects_its_share() {
        let plan = Plan::new(Row::parse("100x10000x1000").unwrap(), 1, 1000, None).unwrap();
        assert_eq!(plan.networks(), 10);
        assert_eq!(plan.vm_network(0), "scale-net-000");
        assert_eq!(plan.vm_network(13), "scale-net-003");
        assert_eq!(Plan::subnet(9), "10.73.0.0/16");
        assert_eq!(plan.vm_labels(1_234)["app"], "a234");
        assert_eq!(Plan::lb_selector(234), "app=a234,tier=web");
        let selected = (0..plan.row.vms)
            .filter(|i| plan.vm_labels(*i)["app"] == "a234")
            .count();
        assert_eq!(selected, 10);
        let plain = Plan::new(Row::parse("10x200").unwrap(), 1, 1000, None).unwrap();
        assert_eq!(
            (plain.networks(), plain.vm_labels(150)["app"].as_str()),
            (1, "a50")
        );
    }

    #[test]
    fn some_vms_are_created_while_the_nodes_are_live() {
        assert_eq!(Plan::default_live_vms(200), 20);
        assert_eq!(Plan::default_live_vms(2_000), 40);
        assert_eq!(Plan::default_live_vms(10_000), 200);
        assert_eq!(Plan::default_live_vms(100_000), 200);
        assert_eq!(Plan::default_live_vms(10), 10);
        let plan = Plan::new(Row::parse("100x2000").unwrap(), 1, 1000, Some(300)).unwrap();
        assert_eq!((plan.live_vms, plan.bulk_vms()), (300, 1_700));
    }

    #[test]
    fn impossible_layouts_are_refused() {
        let row = Row::parse("1x10").unwrap();
        assert!(Plan::new(row, 1, 1000, None).is_err(), "no hypervisor");
        let row = Row::parse("10x200000").unwrap();
        assert!(Plan::new(row, 1, 1000, None).is_err(), "200 networks");
        assert!(Plan::new(row, 1, 2000, None).is_ok());
        assert!(Plan::new(row, 0, 2000, None).is_err(), "no gateway");
    }
}
