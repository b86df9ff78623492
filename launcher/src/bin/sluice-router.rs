//! `sluice-router`: the HTTP front of Sluice. The code lives in the
//! `sluice_router` library; this is its entry point.
fn main() -> std::process::ExitCode {
    sluice_router::main()
}
