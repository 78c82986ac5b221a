<#
.SYNOPSIS
    SpecChat installer for Windows: no admin rights, everything in your user folders.

.DESCRIPTION
    Finds Python 3.10+ (offering to install it for this user from python.org when there is
    none), then runs the installer proper (specchat_setup, next to this script). It creates a
    private Python environment in %LOCALAPPDATA%\specchat\runtime, installs SpecChat with the
    PyTorch build that fits the machine (CUDA when an NVIDIA GPU and driver are found), and adds
    Start-menu and desktop shortcuts and an entry in Settings > Apps. Re-running upgrades in place.

    Run from a PowerShell window:
        powershell -ExecutionPolicy Bypass -File install.ps1
        powershell -ExecutionPolicy Bypass -File install.ps1 --wheelhouse D:\specchat-wheels
    Every option: install.ps1 --help
#>
$ErrorActionPreference = 'Stop'
$PythonVersion = '3.12.10'  # what is installed when the machine has no Python
$Here = Split-Path -Parent $MyInvocation.MyCommand.Path

function Test-Python([string[]]$Command) {
    # True when the command runs a real Python 3.10+ (not the Microsoft Store placeholder).
    try {
        $exe = $Command[0]
        $rest = @()
        if ($Command.Length -gt 1) { $rest = $Command[1..($Command.Length - 1)] }
        $out = & $exe @rest -c 'import sys; print(sys.version_info >= (3, 10))' 2>$null
        return ($LASTEXITCODE -eq 0) -and ($out -eq 'True')
    } catch {
        return $false
    }
}

function Find-Python {
    if ($env:SPECCHAT_PYTHON) {
        if (Test-Python @($env:SPECCHAT_PYTHON)) { return ,@($env:SPECCHAT_PYTHON) }
        throw "SPECCHAT_PYTHON=$($env:SPECCHAT_PYTHON) is not Python 3.10 or newer."
    }
    $candidates = @(
        @('py', '-3.12'), @('py', '-3.11'), @('py', '-3.13'), @('py', '-3.10'), @('python'),
        @("$env:LOCALAPPDATA\Programs\Python\Python312\python.exe")
    )
    foreach ($candidate in $candidates) {
        if (Test-Python $candidate) { return ,$candidate }
    }
    return $null
}

function Install-Python {
    # python.org's installer, for this user only (no admin rights), with progress.
    $arch = if ([Environment]::Is64BitOperatingSystem) { 'amd64' } else { 'win32' }
    if ($env:PROCESSOR_ARCHITECTURE -eq 'ARM64') { $arch = 'arm64' }
    $url = "https://www.python.org/ftp/python/$PythonVersion/python-$PythonVersion-$arch.exe"
    $file = Join-Path $env:TEMP "python-$PythonVersion-$arch.exe"
    Write-Host "Downloading Python $PythonVersion from $url"
    try {
        Invoke-WebRequest -Uri $url -OutFile $file -UseBasicParsing
    } catch {
        throw "Could not download Python ($($_.Exception.Message)). Check the internet connection, or install Python 3.10+ from https://www.python.org/downloads/ and run this installer again."
    }
    Write-Host 'Installing Python for this user (a minute or two)...'
    $process = Start-Process -FilePath $file -Wait -PassThru -ArgumentList @(
        '/quiet', 'InstallAllUsers=0', 'PrependPath=0', 'Include_launcher=0', 'Include_test=0', 'Shortcuts=0')
    Remove-Item $file -ErrorAction SilentlyContinue
    if ($process.ExitCode -ne 0) {
        throw "The Python installer failed (exit code $($process.ExitCode)). Install Python 3.10+ from https://www.python.org/downloads/ and run this installer again."
    }
}

try {
    $python = Find-Python
    if (-not $python) {
        Write-Host 'SpecChat needs Python 3.10 or newer, and none was found.'
        $answer = Read-Host "Download and install Python $PythonVersion for this user from python.org? [Y/n]"
        if ($answer -and -not $answer.ToLower().StartsWith('y')) {
            throw 'Install Python 3.10+ from https://www.python.org/downloads/ and run this installer again.'
        }
        Install-Python
        $python = Find-Python
        if (-not $python) { throw 'Python was installed but cannot be found; open a new PowerShell window and run this installer again.' }
    }
    $command = 'install'
    $rest = @($args)
    if ($rest.Length -gt 0 -and ($rest[0] -eq 'uninstall' -or $rest[0] -eq 'check')) {
        $command = $rest[0]
        if ($rest.Length -gt 1) { $rest = $rest[1..($rest.Length - 1)] } else { $rest = @() }
    }
    $env:PYTHONPATH = $Here
    $exe = $python[0]
    $pythonArgs = @()
    if ($python.Length -gt 1) { $pythonArgs = $python[1..($python.Length - 1)] }
    & $exe @pythonArgs -m specchat_setup $command @rest
    exit $LASTEXITCODE
} catch {
    Write-Host "error: $($_.Exception.Message)" -ForegroundColor Red
    exit 1
}
