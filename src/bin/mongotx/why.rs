//! `mongotx why COLLECTION ID`: a document's committed value, and what holds it (see
//! `mongotx::admin::Explanation`).

use bson::Bson;
use mongotx::admin::Inspector;

use crate::{cli, output, Context};

/// The arguments of `mongotx why`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The collection (one mongotx manages in the database).
    #[arg(value_parser = cli::collection_name)]
    collection: String,
    /// The document's id, taken as a string; for an id of another type, use --id-json instead.
    #[arg(required_unless_present = "id_json", conflicts_with = "id_json")]
    id: Option<String>,
    /// The document's id as extended JSON, for ids that are not strings: 7, 7.5,
    /// '{"$oid": "665f1c2e8a1b2c3d4e5f6a7b"}', '{"$numberLong": "7"}', '{"k": 1}' (a quoted
    /// '"text"' is a string id).
    #[arg(long, value_name = "JSON", value_parser = id_json)]
    id_json: Option<Bson>,
}

/// Parses `--id-json`: relaxed or canonical extended JSON, as `mongoexport` writes it.
fn id_json(text: &str) -> Result<Bson, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let id = Bson::try_from(value).map_err(|e| format!("not extended JSON: {e}"))?;
    match id {
        Bson::Null | Bson::Undefined => Err("a document id cannot be null".into()),
        Bson::Array(_) => Err("a document id cannot be an array".into()),
        id => Ok(id),
    }
}

/// Runs `mongotx why`.
pub(crate) async fn run(ctx: &Context, args: Args) -> Result<(), String> {
    let id = match (args.id, args.id_json) {
        (_, Some(id)) => id,
        (Some(id), None) => Bson::String(id),
        // clap requires one of the two.
        (None, None) => return Err("no document id given: pass ID or --id-json".into()),
    };
    let explanation = Inspector::new(&ctx.store)
        .why(&args.collection, id)
        .await
        .map_err(|e| e.to_string())?;
    output::print(ctx, &explanation, output::lines)
}
