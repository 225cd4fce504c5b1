//! Refusals answered before the request's body was read (a missing token,
//! a viewer's write, a node over its rate) still reach the client: what is
//! left of the body is read and dropped before the answer goes out.
//!
//! Without it hyper closes the connection with the body's bytes unread in
//! the socket, the kernel answers them with a reset, and a client still
//! sending (most send the body after the head) sees a broken connection
//! instead of its 401, 403 or 429. Only a little is drained, briefly: a
//! client that sends more is cut off as before.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use bytes::Bytes;
use http_body::Body as _;
use http_body::{Frame, SizeHint};

/// At most this much of an unread body is drained...
const DRAIN_MAX: usize = 256 * 1024;
/// ...within this long.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// What a request's body hands back when it is dropped unread.
pub struct Returned(Arc<Mutex<Option<Body>>>);

/// The request with its body wrapped so that a body dropped unread comes
/// back through [`Returned`]; see [`drain_unread`].
pub fn returning(req: Request) -> (Request, Returned) {
    let returned = Arc::new(Mutex::new(None));
    let (parts, body) = req.into_parts();
    let body = Body::new(Returning {
        inner: Some(body),
        returned: returned.clone(),
    });
    (Request::from_parts(parts, body), Returned(returned))
}

/// Once the request is answered: drains what its handler left of the body.
pub async fn drain_unread(returned: Returned) {
    // The lock is never held across an await, nor poisoned by a panic
    // while held (a plain take or store).
    let left = returned.0.lock().map(|mut l| l.take()).unwrap_or(None);
    if let Some(body) = left {
        drain(body).await;
    }
}

async fn drain(mut body: Body) {
    let read = async {
        let mut n = 0;
        while let Some(Ok(frame)) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            n += frame.data_ref().map_or(0, Bytes::len);
            if n > DRAIN_MAX {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, read).await;
}

/// A request body that, dropped before its end, hands what is left back.
struct Returning {
    inner: Option<Body>,
    returned: Arc<Mutex<Option<Body>>>,
}

impl http_body::Body for Returning {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        match self.get_mut().inner.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        if let Some(body) = self.inner.take().filter(|b| !b.is_end_stream()) {
            if let Ok(mut slot) = self.returned.lock() {
                *slot = Some(body);
            }
        }
    }
}
