"""Data files shipped with SpecChat (installed as the package `specchat_resources`): the model
catalog and the app icon set. `engine.paths.resource()` finds them in a source checkout, an
editable install and a wheel alike."""
