//! [`run`]: the controller served, its HTTP API and dashboard, its control channel and its clock
//! over one shared state, until a shutdown future resolves. It sits above both the service
//! ([`crate::service`]) and the router ([`crate::http`]), which do not know each other's
//! modules beyond [`AppState`].

use std::future::Future;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::control_channel::{serve_control, tick};
use crate::http_server::serve_http;
use crate::service::AppState;

/// Runs the controller: the HTTP API and dashboard on `http`, the control channel on `control`,
/// and the timeout clock, until `shutdown` resolves.
pub async fn run(
    http: TcpListener,
    control: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let tls = state.config().tls.clone();
    match &tls {
        Some(t) => tracing::info!(
            "control channel and HTTP API over TLS: certificate {}, workers' client certificates \
             checked against {}{}",
            t.files().cert.display(),
            t.files().ca.display(),
            t.files()
                .crl
                .as_ref()
                .map_or_else(String::new, |crl| format!(" and the CRL {}", crl.display()))
        ),
        None => {
            let loopback = control.local_addr().is_ok_and(|a| a.ip().is_loopback())
                && http.local_addr().is_ok_and(|a| a.ip().is_loopback());
            let note = "plain TCP, no TLS (for loopback and tests): the control channel and the \
                        HTTP API's bearer tokens travel in clear";
            if loopback {
                tracing::info!("{note}");
            } else {
                tracing::warn!(
                    "{note}, on a non-loopback address; give --tls-cert/--tls-key/--tls-ca"
                );
            }
        }
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let control_task = tokio::spawn(serve_control(control, state.clone(), stop_rx.clone()));
    let tick_task = tokio::spawn(tick(state.clone(), stop_rx.clone()));
    let app = crate::http::app(state.clone());
    let server = tokio::spawn(serve_http(
        http,
        app,
        state.config().http_limits,
        tls,
        stop_rx.clone(),
    ));
    shutdown.await;
    if state.config().shutdown_workers {
        state.shutdown_workers();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = stop_tx.send(true);
    if let Err(e) = state.stop() {
        tracing::error!("stopping: cannot save the controller's state: {e}");
    }
    let _ = control_task.await;
    let _ = tick_task.await;
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    Ok(())
}
