//! The default route, which is all a guest namespace needs.

use std::net::Ipv4Addr;

use futures::TryStreamExt;
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage};
use rtnetlink::RouteMessageBuilder;
use tracing::info;

use super::{Change, NetError, Netlink};

impl Netlink {
    /// Ensures the main table's IPv4 default route is `via gateway dev link`.
    /// Any other default route is replaced.
    pub async fn ensure_default_route(&self, link: &str, gateway: Ipv4Addr) -> Result<Vec<Change>, NetError> {
        let index = self.require_index(link).await?;
        let routes: Vec<RouteMessage> = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute()
            .try_collect()
            .await
            .map_err(|e| self.err("dump routes", link, e))?;
        let present = routes.iter().any(|r| {
            let table = r
                .attributes
                .iter()
                .find_map(|a| match a {
                    RouteAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(r.header.table));
            table == u32::from(RouteHeader::RT_TABLE_MAIN)
                && r.header.destination_prefix_length == 0
                && r.attributes
                    .contains(&RouteAttribute::Gateway(RouteAddress::Inet(gateway)))
                && r.attributes.contains(&RouteAttribute::Oif(index))
        });
        if present {
            return Ok(Vec::new());
        }
        let msg = RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(gateway)
            .output_interface(index)
            .build();
        self.handle
            .route()
            .add(msg)
            .replace()
            .execute()
            .await
            .map_err(|e| self.err("set default route", link, e))?;
        info!(link = %self.at(link), %gateway, "set default route");
        Ok(vec![Change::DefaultRouteSet {
            link: self.at(link),
            gateway,
        }])
    }
}
