//! VM creates through the API router in memory, over a real store in a
//! temporary data directory: concurrent single creates (grouped into shared
//! transactions) are each answered on their own, and a batch is created
//! whole or not at all — with distinct addresses either way.

mod support;

use std::collections::HashSet;

use axum::body::Body;
use axum::Router;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use support::Server;

struct Api {
    router: Router,
    admin: String,
    _server: Server,
}

impl Api {
    async fn new() -> Api {
        let server = Server::start("creates").await;
        Api {
            router: server.router.clone(),
            admin: server.admin.clone(),
            _server: server,
        }
    }

    async fn call(&self, method: Method, path: &str, body: Value) -> (StatusCode, Value) {
        call(self.router.clone(), &self.admin, method, path, body).await
    }

    /// Creates overlay network `name` on `subnet`.
    async fn overlay(&self, name: &str, subnet: &str) {
        let (status, v) = self
            .call(
                Method::POST,
                "/v1/networks",
                json!({"name": name, "type": "overlay", "subnet": subnet}),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
    }

    async fn vms(&self) -> Vec<Value> {
        let (status, v) = self.call(Method::GET, "/v1/vms", Value::Null).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        v.as_array().unwrap().clone()
    }
}

async fn call(router: Router, token: &str, method: Method, path: &str, body: Value) -> (StatusCode, Value) {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", format!("Bearer {token}"));
    let body = if body.is_null() {
        String::new()
    } else {
        req = req.header("content-type", "application/json");
        body.to_string()
    };
    let resp = router.oneshot(req.body(Body::from(body)).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn ips(vms: &[Value]) -> HashSet<String> {
    vms.iter()
        .map(|vm| vm["ip"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn concurrent_creates_are_each_answered_on_their_own_with_distinct_addresses() {
    let api = Api::new().await;
    // A /26: 61 leasable addresses.
    api.overlay("net", "10.70.0.0/26").await;
    let (status, v) = api
        .call(
            Method::POST,
            "/v1/vms",
            json!({"name": "first", "network": "net"}),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{v}");

    // 70 distinct names, 10 names twice, the first VM's name again, and a
    // network that is not there: 91 creates at once.
    let mut asks: Vec<(String, &str)> = (0..70).map(|i| (format!("vm{i}"), "net")).collect();
    asks.extend((0..10).map(|i| (format!("vm{i}"), "net")));
    asks.push(("first".into(), "net"));
    asks.push(("lost".into(), "nowhere"));
    let mut tasks = tokio::task::JoinSet::new();
    for (name, network) in asks {
        let (router, token) = (api.router.clone(), api.admin.clone());
        tasks.spawn(async move {
            let answer = call(
                router,
                &token,
                Method::POST,
                "/v1/vms",
                json!({"name": name, "network": network}),
            )
            .await;
            (name, answer)
        });
    }
    let mut created = Vec::new();
    let mut refused: Vec<(String, StatusCode, String)> = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (name, (status, v)) = done.unwrap();
        if status == StatusCode::CREATED {
            assert_eq!(v["name"], name.as_str(), "{v}");
            created.push(v);
        } else {
            refused.push((
                name,
                status,
                v["error"]["code"].as_str().unwrap_or_default().to_string(),
            ));
        }
    }
    // 60 addresses were left: 60 of the 70 names got one, each once.
    assert_eq!(created.len(), 60, "refused: {refused:?}");
    assert_eq!(ips(&created).len(), 60, "an address leased twice");
    let count = |code: &str| refused.iter().filter(|r| r.2 == code).count();
    assert_eq!(count("already_exists"), 11, "{refused:?}");
    assert_eq!(count("not_found"), 1, "{refused:?}");
    assert_eq!(count("subnet_exhausted"), 10, "{refused:?}");
    assert!(refused
        .iter()
        .all(|r| r.1 == StatusCode::CONFLICT || r.2 == "not_found"));
    // What the store and the catalog hold is what was answered.
    let listed = api.vms().await;
    assert_eq!(listed.len(), 61);
    assert_eq!(ips(&listed).len(), 61);
    for vm in &created {
        let name = vm["name"].as_str().unwrap();
        let back = listed.iter().find(|l| l["name"] == name).unwrap();
        assert_eq!(back["ip"], vm["ip"]);
        assert_eq!(back["mac"], vm["mac"]);
    }
}

#[tokio::test]
async fn a_batch_is_created_whole_with_distinct_addresses_or_not_at_all() {
    let api = Api::new().await;
    api.overlay("net", "10.80.0.0/26").await;
    let batch = |names: Vec<String>| {
        json!({"vms": names
            .into_iter()
            .map(|n| json!({"name": n, "network": "net", "labels": {"app": "web"}}))
            .collect::<Vec<_>>()})
    };
    let names = |prefix: &str, n: usize| (1..=n).map(|i| format!("{prefix}-{i}")).collect::<Vec<_>>();

    let (status, v) = api
        .call(Method::POST, "/v1/vm-batches", batch(names("web", 40)))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    let vms = v["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 40);
    assert_eq!(
        vms.iter()
            .map(|vm| vm["name"].as_str().unwrap())
            .collect::<Vec<_>>(),
        names("web", 40),
        "in the order asked"
    );
    assert_eq!(ips(vms).len(), 40);
    assert!(vms.iter().all(|vm| vm["labels"]["app"] == "web"));

    // Refused whole: a taken name, a name twice, a missing network, more VMs
    // than the 21 addresses left, none at all, too many.
    let mut taken = names("db", 5);
    taken.push("web-7".into());
    let (status, v) = api.call(Method::POST, "/v1/vm-batches", batch(taken)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "already_exists");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no VM of the batch was created"),
        "{v}"
    );
    let (status, v) = api
        .call(
            Method::POST,
            "/v1/vm-batches",
            batch(vec!["x".into(), "y".into(), "x".into()]),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    let (status, v) = api
        .call(
            Method::POST,
            "/v1/vm-batches",
            json!({"vms": [{"name": "a", "network": "net"}, {"name": "b", "network": "nowhere"}]}),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    let (status, v) = api
        .call(Method::POST, "/v1/vm-batches", batch(names("big", 22)))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["code"], "subnet_exhausted", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no VM of the batch was created"),
        "{v}"
    );
    let (status, v) = api.call(Method::POST, "/v1/vm-batches", json!({"vms": []})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let (status, v) = api
        .call(Method::POST, "/v1/vm-batches", batch(names("many", 1001)))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    // A bad request of one VM refuses the batch, naming the VM.
    let (status, v) = api
        .call(
            Method::POST,
            "/v1/vm-batches",
            json!({"vms": [{"name": "ok", "network": "net"}, {"name": "bad", "network": "net", "exec": " "}]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("\"bad\""), "{v}");
    assert_eq!(
        api.vms().await.len(),
        40,
        "nothing of a refused batch was created"
    );

    // The 21 left fill the subnet exactly, none twice.
    let (status, v) = api
        .call(Method::POST, "/v1/vm-batches", batch(names("last", 21)))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    let listed = api.vms().await;
    assert_eq!(listed.len(), 61);
    assert_eq!(ips(&listed).len(), 61, "an address leased twice");
}

#[tokio::test]
async fn creates_and_batches_are_answered_placed_on_the_ready_hypervisors_with_the_fewest_guests() {
    let api = Api::new().await;
    let state = &api._server.state;
    api.overlay("net", "10.90.0.0/24").await;
    // Three hypervisors; hv-c never heartbeats, so only hv-a and hv-b are Ready.
    hypervisors(&api, &["hv-a", "hv-b", "hv-c"], &["hv-a", "hv-b"]).await;
    // One guest on hv-a already: the next goes to hv-b.
    let (status, v) = api
        .call(
            Method::POST,
            "/v1/vms",
            json!({"name": "pinned", "network": "net", "node": "hv-a"}),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    assert_eq!(v["node"], "hv-a");

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..29 {
        let (router, token) = (api.router.clone(), api.admin.clone());
        tasks.spawn(async move {
            call(
                router,
                &token,
                Method::POST,
                "/v1/vms",
                json!({"name": format!("vm{i}"), "network": "net"}),
            )
            .await
        });
    }
    let mut answered = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (status, v) = done.unwrap();
        assert_eq!(status, StatusCode::CREATED, "{v}");
        answered.push(v);
    }
    let (status, v) = api
        .call(
            Method::POST,
            "/v1/vm-batches",
            json!({"vms": (0..10).map(|i| json!({"name": format!("b{i}"), "network": "net"})).collect::<Vec<_>>()}),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    answered.extend(v["vms"].as_array().unwrap().iter().cloned());

    // Every answer is placed, on a Ready hypervisor, the load even, and
    // what the list shows is what was answered.
    let on = |node: &str| answered.iter().filter(|vm| vm["node"] == node).count();
    assert_eq!(
        on("hv-a") + on("hv-b"),
        39,
        "placed only on Ready hypervisors: {answered:?}"
    );
    assert_eq!((on("hv-a") + 1, on("hv-b")), (20, 20), "the fewest guests first");
    let listed = api.vms().await;
    assert_eq!(listed.len(), 40);
    for vm in &answered {
        let back = listed.iter().find(|l| l["name"] == vm["name"]).unwrap();
        assert_eq!(back["node"], vm["node"], "{back}");
        assert_eq!(back["ip"], vm["ip"]);
    }
    assert_eq!(ips(&listed).len(), 40, "an address leased twice");
    // Every group's guests were taken back from the load in transit once
    // the catalog held them.
    assert!(state.creates.in_transit().load().is_empty());
}

/// Enrolls hypervisors `names`; those in `ready` heartbeat (in the catalog).
async fn hypervisors(api: &Api, names: &[&str], ready: &[&str]) {
    let state = &api._server.state;
    let now = time::OffsetDateTime::now_utc();
    let grant = otherix_store::NodeGrant {
        hypervisor: true,
        ..Default::default()
    };
    for (i, name) in names.iter().enumerate() {
        let id = format!("token-{i}");
        let expires = now + time::Duration::hours(1);
        state
            .store
            .create_join_token(&id, b"secret", name, &grant, false, now, expires)
            .await
            .unwrap();
        let token = state.store.join_token(&id).await.unwrap().unwrap();
        state
            .store
            .enroll_node(&token, name, &format!("fingerprint-{i}"), expires, now)
            .await
            .unwrap()
            .unwrap();
    }
    state.catalog.sync().await.unwrap();
    for name in ready {
        state.catalog.heartbeat(name, now, "test", None);
    }
}

/// Groups are pipelined: the next is placed while the one before still
/// catches up, so guests written but not yet in the catalog count towards
/// their nodes' load — here counted by hand, as a group in its catch-up
/// leaves them.
#[tokio::test]
async fn guests_written_but_not_yet_in_the_catalog_count_towards_their_nodes_load() {
    let api = Api::new().await;
    let state = &api._server.state;
    api.overlay("net", "10.91.0.0/24").await;
    hypervisors(&api, &["hv-a", "hv-b"], &["hv-a", "hv-b"]).await;
    let in_transit = std::collections::HashMap::from([("hv-a".to_string(), 3)]);
    state.creates.in_transit().add(&in_transit);
    let mut nodes = Vec::new();
    for i in 0..4 {
        let (status, v) = api
            .call(
                Method::POST,
                "/v1/vms",
                json!({"name": format!("vm{i}"), "network": "net"}),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        nodes.push(v["node"].as_str().unwrap().to_string());
    }
    // hv-a counts 3 it does not hold yet: hv-b takes three, then the tie
    // goes by name.
    assert_eq!(nodes, ["hv-b", "hv-b", "hv-b", "hv-a"]);
    // Once the catalog holds them they count once, from the catalog: hv-a
    // holds 1, hv-b 3.
    state.creates.in_transit().remove(&in_transit);
    assert!(state.creates.in_transit().load().is_empty());
    let (status, v) = api
        .call(Method::POST, "/v1/vms", json!({"name": "vm4", "network": "net"}))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    assert_eq!(v["node"], "hv-a");
}

/// Waits until `ready` holds, yielding to the creates' tasks meanwhile (10 s
/// at most: a create that never queues fails the test, it does not hang it).
async fn until(what: &str, ready: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !ready() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// A fault put into the store's file: a trigger that fails `table`'s
/// insert of the row named `doomed` (an error of the store, not a refusal),
/// and with it the transaction of whatever group it is in. On a connection
/// of its own, which [`queued_as_one_group`] also uses to hold the file.
async fn fault(api: &Api, table: &str) -> sqlx::SqliteConnection {
    use sqlx::Connection as _;
    let db = api._server.dir.0.join("otherix.db");
    let mut fault = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    sqlx::query(&format!(
        "CREATE TRIGGER inject_fault BEFORE INSERT ON {table} WHEN NEW.name = 'doomed' \
         BEGIN SELECT RAISE(ABORT, 'injected fault'); END"
    ))
    .execute(&mut fault)
    .await
    .unwrap();
    // A first call records the token's use (a write), so that no call
    // below waits for the file on its way in.
    let (status, v) = api.call(Method::GET, "/v1/vms", Value::Null).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    fault
}

/// Creates `first`, then `before`, `doomed` and `after` as one group behind
/// it: `fault` holds the store's file, so the first group forms and waits
/// for it while the three queue; then the file is let go. Each create's
/// answer, by name.
async fn queued_as_one_group<I, O>(
    api: &Api,
    fault: &mut sqlx::SqliteConnection,
    queue: &otherix_server::groups::Groups<I, O>,
    path: &'static str,
    body: fn(&str) -> Value,
) -> std::collections::HashMap<&'static str, (StatusCode, Value)> {
    let create = |name: &'static str| {
        let (router, token) = (api.router.clone(), api.admin.clone());
        tokio::spawn(async move { (name, call(router, &token, Method::POST, path, body(name)).await) })
    };
    sqlx::query("BEGIN IMMEDIATE").execute(&mut *fault).await.unwrap();
    let first = create("first");
    until("the first group leads", || {
        queue.leading() && queue.waiting() == 0
    })
    .await;
    let rest: Vec<_> = ["before", "doomed", "after"].into_iter().map(create).collect();
    until("three creates queue behind it", || queue.waiting() == 3).await;
    sqlx::query("COMMIT").execute(&mut *fault).await.unwrap();
    let mut answers = std::collections::HashMap::new();
    for task in std::iter::once(first).chain(rest) {
        let (name, answer) = task.await.unwrap();
        answers.insert(name, answer);
    }
    answers
}

/// The group's answers: each create on its own, the one at fault alone
/// refused.
fn each_answered_on_its_own(answers: &std::collections::HashMap<&str, (StatusCode, Value)>) {
    for name in ["first", "before", "after"] {
        let (status, v) = &answers[name];
        assert_eq!(*status, StatusCode::CREATED, "{name}: {v}");
    }
    let (status, v) = &answers["doomed"];
    assert_eq!(*status, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
}

/// Takes the fault away.
async fn mend(mut fault: sqlx::SqliteConnection) {
    use sqlx::Connection as _;
    sqlx::query("DROP TRIGGER inject_fault")
        .execute(&mut fault)
        .await
        .unwrap();
    fault.close().await.unwrap();
}

/// A group of creates the store fails as a whole (a trigger fails one VM's
/// insert, and with it the group's transaction) is tried again one create
/// at a time: the others are created, the one at fault alone is refused,
/// and nothing of the failed group stays behind.
#[tokio::test]
async fn a_group_the_store_fails_is_tried_again_one_create_at_a_time() {
    let api = Api::new().await;
    api.overlay("net", "10.92.0.0/24").await;
    let mut fault = fault(&api, "vms").await;
    let answers = queued_as_one_group(
        &api,
        &mut fault,
        api._server.state.creates.vms(),
        "/v1/vms",
        |name| json!({"name": name, "network": "net"}),
    )
    .await;
    each_answered_on_its_own(&answers);

    // What the store and the catalog hold is what was answered: three VMs
    // and three addresses, none held by the failed group.
    let listed = api.vms().await;
    let mut names: Vec<&str> = listed.iter().map(|vm| vm["name"].as_str().unwrap()).collect();
    names.sort_unstable();
    assert_eq!(names, ["after", "before", "first"]);
    assert_eq!(ips(&listed).len(), 3);

    // The fault taken away, the same create goes through, on the next
    // address: the failed group left nothing leased.
    mend(fault).await;
    let (status, v) = api
        .call(
            Method::POST,
            "/v1/vms",
            json!({"name": "doomed", "network": "net"}),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    let mut leased: Vec<std::net::Ipv4Addr> = api
        .vms()
        .await
        .iter()
        .map(|vm| vm["ip"].as_str().unwrap().parse().unwrap())
        .collect();
    leased.sort_unstable();
    let lowest: Vec<std::net::Ipv4Addr> = (2..6).map(|i| std::net::Ipv4Addr::new(10, 92, 0, i)).collect();
    assert_eq!(leased, lowest, "the four lowest free addresses, each once");
}

/// The same for LB creates.
#[tokio::test]
async fn a_group_of_lb_creates_the_store_fails_is_tried_again_one_create_at_a_time() {
    let api = Api::new().await;
    let mut fault = fault(&api, "load_balancers").await;
    let body = |name: &str| json!({"name": name, "port": 80, "selector": "app=web"});
    let answers =
        queued_as_one_group(&api, &mut fault, api._server.state.creates.lbs(), "/v1/lbs", body).await;
    each_answered_on_its_own(&answers);

    let (status, listed) = api.call(Method::GET, "/v1/lbs", Value::Null).await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    let mut names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|lb| lb["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["after", "before", "first"]);

    mend(fault).await;
    let (status, v) = api.call(Method::POST, "/v1/lbs", body("doomed")).await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
}
