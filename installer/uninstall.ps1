<#
.SYNOPSIS
    Removes SpecChat for this user (Settings > Apps runs this). It asks before deleting models
    and conversations; --remove-models, --remove-conversations, --keep-data and --yes answer
    without asking.
#>
$ErrorActionPreference = 'Stop'
$Here = Split-Path -Parent $MyInvocation.MyCommand.Path
$python = '@SYSTEM_PYTHON@'  # the Python that installed SpecChat
try {
    if (-not (Test-Path -LiteralPath $python)) {
        $found = Get-Command python -ErrorAction SilentlyContinue
        if (-not $found) { throw "No Python found to run the uninstaller; delete $Here and the SpecChat shortcuts by hand." }
        $python = $found.Source
    }
    # Run from a copy: the uninstaller deletes the folder it was installed in.
    $copy = Join-Path $env:TEMP ('specchat-uninstall-' + [guid]::NewGuid().ToString('N'))
    New-Item -ItemType Directory -Path $copy | Out-Null
    Copy-Item -Recurse -LiteralPath (Join-Path $Here 'specchat_setup') -Destination $copy
    Set-Location $env:TEMP
    $env:PYTHONPATH = $copy
    & $python -m specchat_setup uninstall @args
    $code = $LASTEXITCODE
    Remove-Item -Recurse -Force -LiteralPath $copy -ErrorAction SilentlyContinue
    if ($Host.Name -eq 'ConsoleHost' -and -not [Console]::IsInputRedirected) { Read-Host 'Press Enter to close' | Out-Null }
    exit $code
} catch {
    Write-Host "error: $($_.Exception.Message)" -ForegroundColor Red
    exit 1
}
