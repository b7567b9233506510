//! `flashmla demo` (being written).
/// Arguments of `flashmla demo`.
#[derive(clap::Args)]
pub struct DemoArgs {}
/// Runs the demo.
pub fn run(_a: &DemoArgs) -> Result<u8, String> { Ok(0) }
