use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;
use vipr::{cli::Args, config::LoggingFormat, settings::Settings};

fn main() -> std::process::ExitCode {
    // `vipr inspect ...` reads the pinned datapath and exits; everything else is the agent,
    // whose flags are kube-proxy's.
    let mut words = std::env::args_os().skip(1);
    if words.next().is_some_and(|word| word == "inspect") {
        return vipr::inspect::main(words.collect());
    }
    vipr::health::process_start();
    let args = Args::parse_kube_proxy_style();
    let settings = Settings::resolve(&args);
    // A bad --config still gets logged, at the level and in the format the flags ask for.
    let level = settings.as_ref().map_or(vipr::config::LogLevel::Info, |settings| settings.log_level);
    let format =
        settings.as_ref().map_or(args.logging_format.unwrap_or_default(), |settings| settings.logging_format);
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level.directive()));
    let logger = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LoggingFormat::Text => logger.with_ansi(std::io::stderr().is_terminal()).init(),
        LoggingFormat::Json => logger.json().with_ansi(false).init(),
    }
    match settings.and_then(|settings| vipr::agent::run(&settings)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
